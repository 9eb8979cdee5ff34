"""What the parts share: the sizes of each mode, the random Qwen2.5-architecture model, the
samples, a Megatron worker on a world of one, and the comparison helpers.

GPU mode sizes one H200 (a Qwen2.5-0.5B-shaped model, 4k-token microbatches, batches up to
256 sequences); CPU mode runs the same code on the tiny shape so that the whole check takes
about a minute on two cores (``tests/integration/test_gpu_check_cpu_mode.py``).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Published config.json values of the Qwen2.5 checkpoints (tied embeddings at these sizes).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024, rope_theta=10000.0,
                 rms_norm_eps=1e-6),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
}
# Sample token ids stay below Qwen's special tokens (151643 and up).
FIRST_SPECIAL_TOKEN = 151643


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one mode."""

    model: str
    """Key of :data:`MODEL_SHAPES` for every Megatron and HF part."""
    train_dtype: str
    """dtype of the low-precision runs: bfloat16 on GPUs; float32 on CPU, where Megatron's
    Float16Optimizer accepts only torch.cuda parameters."""
    train_seqs: int
    """Sequences of the correctness steps (bf16 vs fp32, recompute, offload, distributed optimizer)."""
    prompt_tokens: int
    """Prompt tokens of each of those sequences."""
    response_tokens: int
    """Response tokens of each of those sequences."""
    micro_batch_tokens: int
    """optimizer.micro_batch_tokens of the correctness steps (several microbatches per step)."""
    mem_seqs: int
    """Sequences of the memory-estimator step; they fill one microbatch exactly."""
    mem_seq_len: int
    """Tokens of each of those sequences."""
    decode_batches: tuple[int, ...]
    """Batch sizes of the decode measurement."""
    decode_prompts: tuple[int, ...]
    """Prompt (context) lengths of the decode measurement (two separate per-sequence from
    per-context-token cost)."""
    decode_steps: int
    """Timed decode iterations per (batch, prompt)."""
    throughput_seqs: tuple[int, ...]
    """Sequences per step of the training-throughput measurement (two sizes: fixed + per-token fit)."""
    throughput_seq_len: int
    """Tokens per sequence there."""
    throughput_micro_batch_tokens: int
    """optimizer.micro_batch_tokens there."""
    throughput_steps: int
    """Timed steps per size (after one warm-up step)."""
    ipc_mib: int
    """Size of the IPC bucket."""
    ipc_rounds: int
    """Buckets handed over (the first one opens the handle)."""


SIZES = {
    "gpu": Sizes(model="qwen2.5-0.5b", train_dtype="bfloat16", train_seqs=8, prompt_tokens=64, response_tokens=448,
                 micro_batch_tokens=2048, mem_seqs=4, mem_seq_len=1024,
                 decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), decode_prompts=(128, 1024), decode_steps=24,
                 throughput_seqs=(8, 16), throughput_seq_len=1024, throughput_micro_batch_tokens=8192,
                 throughput_steps=3, ipc_mib=1024, ipc_rounds=5),
    "cpu": Sizes(model="tiny", train_dtype="float32", train_seqs=8, prompt_tokens=8, response_tokens=24,
                 micro_batch_tokens=96, mem_seqs=2, mem_seq_len=64,
                 decode_batches=(1, 4, 16), decode_prompts=(16, 64), decode_steps=6,
                 throughput_seqs=(2, 16), throughput_seq_len=64, throughput_micro_batch_tokens=512,
                 throughput_steps=3, ipc_mib=32, ipc_rounds=3),
}


@dataclass
class Context:
    """What a part gets: its mode, sizes and the run's work directory."""

    mode: str
    """'gpu' or 'cpu'."""
    workdir: Path
    """Shared by all parts of one run: model/, tiny_model/, logs/, results/, calibration files."""

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.mode]

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.gpu else torch.device("cpu")

    @property
    def model_dir(self) -> Path:
        return self.workdir / "model"

    @property
    def tiny_dir(self) -> Path:
        return self.workdir / "tiny_model"

    def require_model(self) -> Path:
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir}: no model (the model_setup part writes it)")
        return self.model_dir


class SkipPart(Exception):
    """Raised by a part that cannot run in this mode; the message is the reason."""


def outcome(checks: dict[str, bool], summary: str, figures: dict[str, Any]) -> dict[str, Any]:
    """A part's row: 'pass' when every check held, else 'fail' naming the failed checks first."""
    failed = [name for name, ok in checks.items() if not ok]
    figures["checks"] = checks
    return {"status": "fail" if failed else "pass",
            "summary": (f"FAILED {', '.join(failed)}; " if failed else "") + summary, "figures": figures}


def prepare_process(ctx: Context, deterministic: bool) -> None:
    """Per-part process set-up: the device, thread count, and deterministic kernels for the parts
    that compare two runs bit for bit (CUBLAS_WORKSPACE_CONFIG is set by the runner)."""
    if ctx.gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("GPU mode, but torch sees no CUDA device (use --cpu on a machine without one)")
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    if deterministic:
        # On the GPU, warn_only=True only warns about a nondeterministic kernel and runs it anyway:
        # the first H200 run's repeated bf16 step differed (max |diff| 2.4e-4) through cuDNN
        # attention's backward. warn_only=False makes flash attention's backward deterministic, and
        # the cuDNN and memory-efficient SDPA backends are switched off so attention can only take
        # flash or math. CPU kernels are deterministic already; there warn_only stays True.
        torch.use_deterministic_algorithms(True, warn_only=not ctx.gpu)
        if ctx.gpu:
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)


def sync(ctx: Context) -> None:
    if ctx.gpu:
        torch.cuda.synchronize()


def timed(ctx: Context, fn, *args, **kwargs) -> tuple[Any, float]:
    """(fn(...), wall seconds) with the device synchronised on both sides."""
    sync(ctx)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(ctx)
    return out, time.perf_counter() - start


# ----------------------------------------------------------------------------- the model
def build_random_qwen2(out_dir: Path, shape: str, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """A random-init Qwen2.5-architecture HF checkpoint in ``out_dir`` (bf16 safetensors, no
    tokenizer: nothing here tokenises). The weights are rounded to bf16 before saving, so the
    fp32 and bf16 runs start from identical values and differ only in arithmetic. QKV biases get
    small random values so a bias routed to the wrong head would show. Returns a description."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**MODEL_SHAPES[shape], tie_word_embeddings=True, hidden_act="silu",
                         use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
        model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "params": params, "dir": str(out_dir)}


def make_samples(shape: str, num: int, prompt_tokens: int, response_tokens: int, seed: int) -> list:
    """Random-token samples of fixed lengths for a model of ``shape`` with random advantages (no
    old/engine logprobs: the steps run with ``algorithm.recompute_old_logprobs=false``)."""
    from megatron_rl.sample import Prompt, Sample

    top = min(MODEL_SHAPES[shape]["vocab_size"], FIRST_SPECIAL_TOKEN)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        prompt = Prompt(prompt_id=f"gpu_check:{i}", answer="",
                        token_ids=torch.randint(0, top, (prompt_tokens,), generator=g).tolist())
        out.append(Sample(prompt=prompt, response_index=0,
                          response_ids=torch.randint(0, top, (response_tokens,), generator=g).tolist(),
                          advantage=float(torch.randn(1, generator=g))))
    return out


# ----------------------------------------------------------------------------- Megatron worker
def worker_config(ctx: Context, *, dtype: str, micro_batch_tokens: int, recompute: str = "none",
                  distributed_optimizer: bool = False, impl: str = "local", lr: float = 1e-4) -> Any:
    """A trainer config for one rank: no grad clipping (the gradients stay raw), the training
    forward's own old logprobs (ratio 1: the loss gradient is -A * grad log p / N)."""
    from megatron_rl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.cluster.device = "cuda" if ctx.gpu else "cpu"
    cfg.model.dtype = dtype
    cfg.model.transformer_impl = impl
    cfg.parallel.recompute_granularity = recompute
    cfg.parallel.use_distributed_optimizer = distributed_optimizer
    cfg.optimizer.micro_batch_tokens = micro_batch_tokens
    cfg.optimizer.grad_clip = 0.0
    cfg.optimizer.lr = lr
    cfg.algorithm.recompute_old_logprobs = False
    return cfg


def make_worker(ctx: Context, cfg: Any, model_dir: Path, port: int) -> Any:
    """A MegatronWorker on a world of one (nccl on the GPU, gloo + the CPU shim on CPU) with
    ``model_dir`` loaded. Later workers of the same process reuse the world (shut the previous
    one down with ``destroy_world=False``)."""
    from megatron_rl.training.megatron_worker import MegatronWorker

    worker = MegatronWorker(cfg, 0, 1, "127.0.0.1", port)
    worker.load_hf(str(model_dir))
    return worker


def policy_loss(cfg: Any):
    """The trainer's own PPO/GRPO loss with the config's algorithm section bound."""
    from megatron_rl.algorithms.losses import compute_policy_loss

    return functools.partial(compute_policy_loss, cfg=cfg.algorithm)


def grads_of(worker: Any) -> dict[str, torch.Tensor]:
    """fp32 copies (on the model's device) of the DDP main gradients, Megatron names."""
    from megatron_rl.training.weights_io import local_views

    views = local_views(worker.model, pick=lambda p: getattr(p, "main_grad", None))
    return {n: t.float().clone() for n, t in views.items()}


def weights_of(worker: Any) -> dict[str, torch.Tensor]:
    """fp32 copies (on the model's device) of the model's weights, Megatron names."""
    from megatron_rl.training.weights_io import local_views

    return {n: t.float().clone() for n, t in local_views(worker.model).items()}


def rel_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """||got - ref|| / ||ref|| over all tensors, the worst tensor's own relative error and the
    largest absolute difference. Key sets must match."""
    if got.keys() != ref.keys():
        raise KeyError(f"tensor names differ: only in got {sorted(got.keys() - ref.keys())[:5]}, "
                       f"only in ref {sorted(ref.keys() - got.keys())[:5]}")
    num = den = 0.0
    worst, worst_name, max_abs = 0.0, "", 0.0
    for name, r in ref.items():
        g = got[name].to(r.device, torch.float32)
        d = float((g - r).norm()) ** 2
        n = float(r.norm()) ** 2
        num, den = num + d, den + n
        rel = (d ** 0.5) / (n ** 0.5 + 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
        max_abs = max(max_abs, float((g - r).abs().max()) if r.numel() else 0.0)
    return {"rel": (num ** 0.5) / (den ** 0.5 + 1e-30), "worst_rel": worst, "worst_tensor": worst_name,
            "max_abs": max_abs}


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def shim_state() -> str:
    """'applied' when megatron_rl's CUDA->CPU shim patched this process (it must not on a GPU)."""
    from megatron_rl.distributed import cpu_shim

    return "applied" if cpu_shim._APPLIED else "off"


def check_shim(ctx: Context) -> None:
    """On the GPU the CPU shim must never be applied; on CPU it must be (gloo needs it)."""
    state = shim_state()
    if ctx.gpu and state != "off":
        raise AssertionError("the CPU shim was applied in a GPU process")
    if not ctx.gpu and state != "applied":
        raise AssertionError("CPU mode ran Megatron without the CPU shim")


def gib(nbytes: float) -> float:
    return nbytes / 1024 ** 3


def memory_allocated(ctx: Context) -> int:
    return torch.cuda.memory_allocated() if ctx.gpu else 0


def release(ctx: Context) -> None:
    """Give freed device memory back between workers (CUDA caching allocator)."""
    import gc

    gc.collect()
    if ctx.gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def stop_child(proc: Any) -> None:
    """End a part's helper process: it exits by itself after its last message; killed if it has not
    within 30 s (a hung CUDA call), so the part still reports."""
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join(5)

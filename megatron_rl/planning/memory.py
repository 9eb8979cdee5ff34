"""Per-GPU memory estimate of a colocated (hybrid-engine) run: trainer and rollout engine share
every GPU, so each GPU must hold the trainer's resident state plus, in turn, the engine's memory
pool (rollout phase) and the training activations (train phase).

What is counted, per GPU (bf16 training, the layout of ``megatron_rl.training.megatron_worker``):

* weights: bf16 parameters of the worst pipeline stage / TP (embedding on the first stage,
  lm_head on the last; both when PP = 1);
* gradients: fp32 main grads (the worker sets ``grad_reduce_in_fp32=True``);
* optimizer: fp32 master copy + Adam m and v (12 B/param), divided by DP x CP when
  ``parallel.use_distributed_optimizer`` shards it;
* activations: one microbatch of ``optimizer.micro_batch_tokens`` tokens (split by CP) stored
  for backward in every layer (flash attention, so no s^2 term), times the PP microbatches 1F1B
  keeps in flight on the first stage, plus the fp32 logits of the vocab-parallel cross entropy
  on the last stage. ``parallel.recompute_granularity`` changes what a layer stores (see
  :func:`activation_bytes`): 'full' keeps only each layer's input plus, during the backward, one
  recomputed layer; 'selective' drops the core attention's own state, which under flash
  attention is only its softmax statistics (the s^2 scores it removes on non-flash attention are
  not counted here in the first place);
* KV cache: what is left of vLLM's pool (``rollout.gpu_memory_utilization`` x GPU memory) after
  the engine's weight shard and its activation reserve.

With ``trainer.offload_during_rollout`` the trainer's weights (and the reference model's),
gradients and optimizer state are off the GPU while the engines generate
(``megatron_rl.training.memory_offload``: grad buffers freed, the rest in host memory), so the
rollout phase holds only the engine pool and the per-process overheads.

The assumptions that are not visible in the recipe are explicit in :class:`MemoryAssumptions`
and printed with the estimate. The two phase peaks here are what the recipe's switches allow;
``megatron_rl.planning.moments`` walks every transition of a step (the push, an elastic-TP
switch, the stream trainer's handoff) with the recipe's actual sleep / offload settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.architectures import ModelShape

GIB = 1024 ** 3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model (datasheet numbers; efficiencies live in the simulator)."""

    name: str
    memory_gib: float
    hbm_gb_per_s: float
    bf16_tflops: float
    nvlink_gb_per_s: float


GPUS = {
    # H800 SXM: H100 compute and HBM3, NVLink cut to 400 GB/s.
    "h800": GpuSpec("H800-80GB", 80.0, 3350.0, 989.0, 400.0),
    "h100": GpuSpec("H100-80GB", 80.0, 3350.0, 989.0, 900.0),
    "a100": GpuSpec("A100-80GB", 80.0, 2039.0, 312.0, 600.0),
    # H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s; about 139 GiB usable as torch sees it on
    # the lent machine (tests/gpu/check measures against this entry).
    "h200": GpuSpec("H200-141GB", 139.0, 4800.0, 989.0, 900.0),
}


class PlanError(ConfigError):
    """The recipe cannot run on the planned cluster (does not fit, bad placement)."""


@dataclass(frozen=True)
class MemoryAssumptions:
    """Hybrid-engine behaviour and fixed overheads the estimate relies on."""

    engine_sleeps_during_training: bool = True
    """vLLM sleep mode while the trainer trains: engine weights go to host memory (level 1) or
    are dropped (level 2) and the KV cache is dropped, so training activations can use that memory."""
    trainer_offload_during_rollout: bool = False
    """What-if override: estimate as if ``trainer.offload_during_rollout`` were on (trainer
    weights, grads and optimizer state off the GPU during rollout). The recipe's field drives the
    estimate; this only forces it on (``rollpacker-plan-cluster --assume-trainer-offload``)."""
    process_overhead_gib: float = 3.0
    """Per process on a GPU (trainer rank, engine worker): CUDA context, NCCL buffers, allocator
    fragmentation."""
    engine_activation_gib: float = 2.0
    """vLLM's reserve for forward activations and the sampler inside its pool."""


@dataclass
class MemoryEstimate:
    """Per-GPU figures in GiB for the most loaded GPU, by phase."""

    trainer: dict[str, float]
    engine: dict[str, float]
    overhead_gib: float
    rollout_peak_gib: float
    train_peak_gib: float
    kv_tokens_per_engine: int
    max_model_len: int
    capacity_gib: float
    problems: list[str] = field(default_factory=list)
    trainer_offload: str = ""
    """Why the trainer is off the GPU during rollout ('trainer.offload_during_rollout' or
    'assumed'); empty when it stays resident."""
    rollout_trainer_gib: float = 0.0
    """Trainer state left on the GPU during rollout (0 when offloaded)."""
    recompute: str = "none"
    """``parallel.recompute_granularity`` the activation figure assumes."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def concurrent_full_sequences(self) -> float:
        """How many max_model_len sequences one engine's KV cache holds at once."""
        return self.kv_tokens_per_engine / max(1, self.max_model_len)


def max_model_len(cfg: RunConfig) -> int:
    return cfg.rollout.max_model_len or cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def trainer_params_per_gpu(cfg: RunConfig, shape: ModelShape) -> int:
    """Parameters on the most loaded trainer GPU (the pipeline stage holding an embedding)."""
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    layers = shape.arch.num_layers // pp * shape.layer_params
    embeddings = shape.embedding_params * (2 if pp == 1 and not shape.arch.tie_word_embeddings else 1)
    return (layers + embeddings) // tp


def activation_bytes_per_token_layer(cfg: RunConfig, shape: ModelShape) -> float:
    """bf16 tensors one decoder layer stores for backward without recomputation, per token, on
    one TP rank."""
    tp = cfg.parallel.tensor_model_parallel_size
    a = shape.arch
    h, ffn, kv = a.hidden_size, a.intermediate_size, a.num_kv_heads * a.head_dim
    # Split across TP: q/k/v, attention output, fc1 (gate+up) output, SwiGLU output.
    tp_sharded = 2 * ((h + 2 * kv) + h + 2 * ffn + ffn)
    # Full-hidden tensors (norm inputs/outputs, residuals, linear inputs): split only under SP.
    per_sequence = 2 * 6 * h
    return (tp_sharded / tp + attention_internal_bytes_per_token_layer(cfg, shape)
            + per_sequence / (tp if cfg.parallel.sequence_parallel else 1))


def attention_internal_bytes_per_token_layer(cfg: RunConfig, shape: ModelShape) -> float:
    """What the core attention stores beyond its inputs (q/k/v) and output, per token and layer on
    one TP rank: with flash attention only the fp32 softmax statistics (log-sum-exp) of each
    head. 'selective' recompute saves exactly this."""
    return 4 * shape.arch.num_heads / cfg.parallel.tensor_model_parallel_size


def layer_input_bytes_per_token(cfg: RunConfig, shape: ModelShape) -> float:
    """The bf16 hidden state entering a decoder layer, per token on one TP rank (split under
    SP): all that 'full' recompute keeps of a layer until its backward."""
    return 2 * shape.arch.hidden_size / (cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1)


def activation_bytes(cfg: RunConfig, shape: ModelShape) -> float:
    """Activation bytes stored for backward on the most loaded trainer GPU (first PP stage): one
    microbatch per PP stage in flight (1F1B), i.e. all layers' worth, under
    ``parallel.recompute_granularity``."""
    par = cfg.parallel
    tokens = cfg.optimizer.micro_batch_tokens / par.context_parallel_size
    # 1F1B keeps up to PP microbatches in flight on the first stage: all layers' worth in total.
    layers_in_flight = shape.arch.num_layers // par.pipeline_model_parallel_size * par.pipeline_model_parallel_size
    per_layer = activation_bytes_per_token_layer(cfg, shape)
    if par.recompute_granularity == "full":
        # Layer inputs stay; the backward recomputes one layer at a time and holds its activations.
        return tokens * (layers_in_flight * layer_input_bytes_per_token(cfg, shape) + per_layer)
    if par.recompute_granularity == "selective":
        per_layer -= attention_internal_bytes_per_token_layer(cfg, shape)
    return tokens * layers_in_flight * per_layer


def estimate_memory(cfg: RunConfig, shape: ModelShape, gpu: GpuSpec,
                    assume: MemoryAssumptions = MemoryAssumptions()) -> MemoryEstimate:
    """Per-GPU memory of the most loaded GPU; ``problems`` lists every way it does not fit."""
    par = cfg.parallel
    bf16 = cfg.model.dtype == "bfloat16"
    params = trainer_params_per_gpu(cfg, shape)
    shard = par.data_parallel_size * par.context_parallel_size if par.use_distributed_optimizer else 1
    trainer = {
        "weights": params * (2 if bf16 else 4) / GIB,
        "gradients": params * 4 / GIB,
        "optimizer": params * (12 if bf16 else 8) / shard / GIB,
    }
    if cfg.model.use_reference_model or cfg.algorithm.kl_coef > 0:
        trainer["reference weights"] = params * (2 if bf16 else 4) / GIB
    tokens = cfg.optimizer.micro_batch_tokens / par.context_parallel_size
    trainer["activations"] = activation_bytes(cfg, shape) / GIB
    # bf16 logits + fp32 softmax copy + fp32 gradient of the vocab-parallel cross entropy.
    trainer["logits"] = tokens * shape.arch.vocab_size / par.tensor_model_parallel_size * 10 / GIB
    resident = trainer["weights"] + trainer["gradients"] + trainer["optimizer"] + trainer.get("reference weights", 0.0)

    rtp = cfg.rollout.tensor_parallel_size
    pool = cfg.rollout.gpu_memory_utilization * gpu.memory_gib
    engine = {"pool": pool, "weights": shape.total_params * 2 / rtp / GIB, "activation reserve": assume.engine_activation_gib}
    engine["kv cache"] = pool - engine["weights"] - engine["activation reserve"]
    # K/V heads split across TP ranks; beyond num_kv_heads ranks each holds a replica of one head.
    kv_per_gpu_token = shape.kv_bytes_per_token / min(rtp, shape.arch.num_kv_heads)
    kv_tokens = max(0, int(engine["kv cache"] * GIB / kv_per_gpu_token))

    overhead = 2 * assume.process_overhead_gib
    offload = ("trainer.offload_during_rollout" if cfg.trainer.offload_during_rollout
               else "assumed" if assume.trainer_offload_during_rollout else "")
    # On GPUs the offload frees the grad buffers and moves optimizer state and weights (the
    # reference model's too) to host memory: nothing of the trainer's state stays.
    offloaded = resident if offload else 0.0
    rollout_peak = overhead + resident - offloaded + pool
    train_peak = overhead + resident + trainer["activations"] + trainer["logits"] + (
        0.0 if assume.engine_sleeps_during_training else pool)
    est = MemoryEstimate(trainer, engine, overhead, rollout_peak, train_peak, kv_tokens, max_model_len(cfg),
                         gpu.memory_gib, trainer_offload=offload, rollout_trainer_gib=resident - offloaded,
                         recompute=par.recompute_granularity)
    cap = gpu.memory_gib
    if engine["kv cache"] <= 0 or kv_tokens < est.max_model_len:
        est.problems.append(
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization:g} gives vLLM {pool:.1f} GiB, which "
            f"after its weight shard ({engine['weights']:.1f} GiB at rollout.tensor_parallel_size={rtp}) and "
            f"activation reserve leaves KV for {kv_tokens} tokens, less than one {est.max_model_len}-token sequence")
    if rollout_peak > cap:
        room = cap - overhead - est.rollout_trainer_gib
        held = ("offloaded to host" if offload else f"weights {trainer['weights']:.1f}, gradients "
                f"{trainer['gradients']:.1f}, optimizer {trainer['optimizer']:.1f}")
        est.problems.append(
            f"rollout phase needs {rollout_peak:.1f} GiB per GPU > {cap:.0f} GiB {gpu.name}: trainer resident "
            f"{est.rollout_trainer_gib:.1f} GiB ({held}) + vLLM pool {pool:.1f} GiB + overhead {overhead:.1f} GiB; "
            f"at most {max(room, 0.0) / cap:.2f} is left for rollout.gpu_memory_utilization")
    if train_peak > cap:
        est.problems.append(
            f"train phase needs {train_peak:.1f} GiB per GPU > {cap:.0f} GiB {gpu.name}: trainer resident "
            f"{resident:.1f} GiB + activations {trainer['activations']:.1f} GiB "
            f"(parallel.recompute_granularity={par.recompute_granularity}) + logits {trainer['logits']:.1f} GiB "
            f"for optimizer.micro_batch_tokens={cfg.optimizer.micro_batch_tokens}"
            + ("" if assume.engine_sleeps_during_training else f" + vLLM pool {pool:.1f} GiB (engine not sleeping)"))
    if est.problems:
        est.problems.append("raise parallel.tensor_model_parallel_size / pipeline_model_parallel_size / "
                            "context_parallel_size, or " + ", ".join(_unused_savings(cfg, offload)))
    return est


def _unused_savings(cfg: RunConfig, offload: str) -> list[str]:
    """The memory switches the recipe does not use yet, as advice."""
    par, out = cfg.parallel, []
    if not par.use_distributed_optimizer:
        out.append("set parallel.use_distributed_optimizer=true")
    if not par.sequence_parallel:
        out.append("enable parallel.sequence_parallel")
    if par.recompute_granularity != "full":
        out.append("set parallel.recompute_granularity=full (train phase)")
    if not offload:
        out.append("set trainer.offload_during_rollout=true (rollout phase)")
    return out + ["lower optimizer.micro_batch_tokens"]


def format_memory(est: MemoryEstimate, assume: MemoryAssumptions) -> list[str]:
    """Human-readable lines of the estimate (GiB per GPU)."""
    t, e = est.trainer, est.engine
    lines = ["per-GPU memory estimate (GiB, most loaded GPU):"]
    lines.append("  trainer: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    lines.append(f"  engine:  pool {e['pool']:.1f} = weights {e['weights']:.1f} + activation reserve "
                 f"{e['activation reserve']:.1f} + KV cache {e['kv cache']:.1f}")
    lines.append(f"  KV cache per engine: {est.kv_tokens_per_engine:,} tokens = "
                 f"{est.concurrent_full_sequences:.1f} full {est.max_model_len}-token sequences")
    lines.append(f"  overhead (CUDA context, NCCL, fragmentation; 2 processes): {est.overhead_gib:.1f}")
    lines.append(f"  rollout phase peak: {est.rollout_peak_gib:.1f} / {est.capacity_gib:.0f}")
    lines.append(f"  train phase peak:   {est.train_peak_gib:.1f} / {est.capacity_gib:.0f}")
    offload = (f"True ({est.trainer_offload})" if est.trainer_offload else "False")
    lines.append(f"  assumes: engine sleeps during training = {assume.engine_sleeps_during_training}, trainer "
                 f"offloaded during rollout = {offload}, activation recomputation = {est.recompute} "
                 "(parallel.recompute_granularity), flash attention (no s^2 term)")
    return lines

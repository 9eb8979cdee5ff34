"""Device check: a trainer checkpoint with Megatron's distributed optimizer, saved and loaded on
one GPU (world 1), restores the optimizer exactly and the next step matches.

    python -m tests.gpu.dist_optimizer_check WORK_DIR [--dtype bfloat16|float32]   # from the repository root

prints one JSON line with what it measured and exits 0 when every check holds (1 otherwise).
From Python: :func:`check_distributed_optimizer_round_trip`. Needs torch (CUDA for the real
check), megatron-core 0.16.1, transformers and safetensors; no vLLM, no Ray.

What it does: build the tiny Qwen2 model, take one optimizer step with
``parallel.use_distributed_optimizer`` (bf16 weights + fp32 masters by default), save a trainer
checkpoint (``megatron_rl/training/dist_checkpoint.py``: the optimizer state in Megatron's
``fully_reshardable`` form), take a second step; then a fresh worker built from *other* weights
loads the checkpoint and takes the same second step. Checked: the optimizer's fp32 masters,
exp_avg, exp_avg_sq and step are bit-identical after the load, and the second step's loss,
gradient norm and resulting weights equal the uninterrupted run's.

The CPU suite runs this same function (tests/integration/test_dist_checkpoint.py), with the
distributed optimizer's CUDA-type check satisfied by a test-only patch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from megatron_rl.distributed.ports import free_port as _free_port


def _batch(seed: int, num: int = 8) -> list:
    from megatron_rl.sample import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n_p, n_r = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(1, 14, (1,), generator=g))
        prompt = Prompt(prompt_id=f"c:{i}", token_ids=torch.randint(0, 256, (n_p,), generator=g).tolist(), answer="")
        out.append(Sample(prompt=prompt, response_index=0, response_ids=torch.randint(0, 256, (n_r,), generator=g).tolist(),
                          advantage=float(torch.randn(1, generator=g)),
                          old_logprobs=(-5.0 + torch.randn(n_r, generator=g)).tolist()))
    return out


def _loss(logprobs, old_logprobs, advantages, mask, *, num_tokens_total: int, **_: Any):
    per_token = -advantages * logprobs + 0.5 * (logprobs - old_logprobs) ** 2
    loss = (per_token * mask).sum() / num_tokens_total
    return loss, {"loss": loss}


def _optimizer_snapshot(worker: Any) -> dict[str, torch.Tensor]:
    """Every model parameter's fp32 master shard and Adam state (+ step), as CPU copies."""
    out: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in worker.model.named_parameters()}
    for i, inner in enumerate(getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])):
        per_param_step = False
        for param in inner.model_param_group_index_map:
            for key, value in inner._get_main_param_and_optimizer_states(param).items():
                out[f"{i}.{names[param]}.{key}"] = torch.as_tensor(value).detach().float().cpu().clone()
                per_param_step |= key == "step"
        for g, group in enumerate(inner.optimizer.param_groups):
            if not per_param_step and "step" in group:  # TE / Apex FusedAdam keep the step here
                out[f"{i}.group{g}.step"] = torch.tensor(float(group["step"]))
    return out


def check_distributed_optimizer_round_trip(work_dir: str | Path, dtype: str = "bfloat16",
                                           build_context: Callable[[], ContextManager] = contextlib.nullcontext,
                                           port: int | None = None) -> dict[str, Any]:
    """Run the check described in the module docstring in this process (rank 0 of a world of
    one; it must not be in a torch.distributed job yet). ``build_context`` wraps the model and
    optimizer construction (the CPU test passes its CUDA-type patch). Returns the measured
    values; raises AssertionError naming the first check that fails."""
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.model.tiny import build_tiny_qwen2
    from megatron_rl.training.megatron_worker import MegatronWorker

    work = Path(work_dir)
    hf = build_tiny_qwen2(work / "hf", seed=0)
    other = build_tiny_qwen2(work / "other", seed=7)
    cfg = RunConfig()
    cfg.cluster.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.model.dtype = dtype
    cfg.parallel.use_distributed_optimizer = True
    cfg.algorithm.recompute_old_logprobs = True  # the steps are given their old logprobs
    cfg.optimizer.lr, cfg.optimizer.grad_clip, cfg.optimizer.micro_batch_tokens = 1e-3, 1.0, 64
    port = port or _free_port()

    def build(model_dir: Path) -> Any:
        worker = MegatronWorker(cfg, 0, 1, "127.0.0.1", port)
        with build_context():
            worker.load_hf(str(model_dir))
        return worker

    first = build(hf)
    first.train_step(_batch(1), _loss)
    saved_optimizer = _optimizer_snapshot(first)
    ckpt = work / "step"
    ckpt.mkdir(parents=True, exist_ok=True)
    first.save_checkpoint(str(ckpt))
    saved_weights = first.export_hf_state_dict()
    want = first.train_step(_batch(2), _loss)
    want_weights = first.export_hf_state_dict()
    first.shutdown(destroy_world=False)

    second = build(other)
    info = second.load_checkpoint(str(ckpt))
    loaded_weights = second.export_hf_state_dict()
    loaded_optimizer = _optimizer_snapshot(second)
    got = second.train_step(_batch(2), _loss)
    got_weights = second.export_hf_state_dict()
    second.shutdown(destroy_world=True)

    result = {
        "device": cfg.cluster.device, "dtype": dtype, "steps_done": info["steps_done"],
        "optimizer_tensors": len(saved_optimizer),
        "optimizer_max_diff": max(float((loaded_optimizer[k] - v).abs().max()) for k, v in saved_optimizer.items()),
        "weights_max_diff_after_load": max(float((loaded_weights[k] - v).abs().max()) for k, v in saved_weights.items()),
        "loss": [want["loss"], got["loss"]], "grad_norm": [want["grad_norm"], got["grad_norm"]],
        "weights_max_diff_after_step": max(float((got_weights[k] - v).abs().max()) for k, v in want_weights.items()),
    }
    assert info["steps_done"] == 1, result
    assert loaded_optimizer.keys() == saved_optimizer.keys(), result
    assert any(k.endswith(".exp_avg_sq") for k in saved_optimizer), result
    assert result["optimizer_max_diff"] == 0.0, f"optimizer state changed by save+load: {result}"
    assert result["weights_max_diff_after_load"] == 0.0, f"weights changed by save+load: {result}"
    assert abs(got["loss"] - want["loss"]) <= 1e-6 * max(1.0, abs(want["loss"])), f"loss differs: {result}"
    assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"], f"grad norm differs: {result}"
    # An Adam step with the wrong step counter or moments moves weights by ~lr (1e-3).
    assert result["weights_max_diff_after_step"] <= 1e-5, f"the resumed step differs: {result}"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work_dir", help="scratch directory (models and the checkpoint go there)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    try:
        result = check_distributed_optimizer_round_trip(args.work_dir, args.dtype)
    except AssertionError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    print(json.dumps({"ok": True, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The parts of the check, in run order, with their budgets (GPU s, CPU s) and dependencies.

The simulator runs before quantize_export: it needs two earlier parts' files, and the third H200
run left it 33 s of the deadline, too few for its two simulations. push_memory (not yet run on a
GPU) comes last, so that it is the part the deadline cuts, not one with a measured record.

CPU budgets are generous: the CPU mode shares a 2-core box with whatever else runs there."""
from __future__ import annotations

from collections.abc import Callable

from tests.gpu.check.harness import PartSpec


def _spec(name: str, gpu_s: float, cpu_s: float, what: str, needs: tuple[str, ...] = ("model_setup",),
          cpu_skip: str = "") -> PartSpec:
    return PartSpec(name, {"gpu": gpu_s, "cpu": cpu_s}, needs, what, cpu_skip)


SPECS: list[PartSpec] = [
    _spec("model_setup", 90, 120, "random Qwen2.5-architecture model (0.5B on GPU, tiny on CPU), bf16 safetensors",
          needs=()),
    _spec("cuda_ipc", 90, 120, "bucket of weights to another process by reduce_tensor handle (vLLM ipc backend; "
          "CPU: shared memory) vs a device copy", needs=()),
    _spec("push_pairing", 60, 60, "tensor push pairing: GPU UUIDs across device numberings, IPC slots opened on "
          "their own GPU only (CPU: pairing by node, other-GPU handles refused)", needs=()),
    _spec("nccl_groups", 90, 120, "nccl world + Megatron groups (collectives), tiny-model logprobs vs HF, HF export"),
    _spec("bf16_train_step", 150, 120, "bf16 train step (local spec) vs fp32 on the same device, fp32 vs transformers"),
    _spec("transformer_engine", 150, 30, "TE layer spec in bf16 vs fp32 (only where transformer_engine imports)",
          cpu_skip="Transformer Engine needs a GPU"),
    _spec("recompute", 150, 120, "activation recompute full / selective give the no-recompute gradient"),
    _spec("offload", 150, 120, "trainer.offload_during_rollout: memory before/after, next step identical"),
    _spec("distributed_optimizer", 150, 30, "distributed optimizer on a world of 1: same step, checkpoint round trip",
          cpu_skip="Megatron's distributed optimizer accepts only torch.cuda parameters"),
    _spec("memory_estimator", 150, 120, "planning/memory.py estimate vs measured bytes, per component"),
    _spec("decode", 120, 120, "HF static-cache decode ms/iteration vs batch 1..256 -> engine_constants.json"),
    _spec("decode_cuda_graph", 120, 30, "the same decode replayed as CUDA graphs (as vLLM runs it), logits vs eager "
          "-> engine_constants_graph.json", cpu_skip="CUDA graphs need a GPU"),
    _spec("train_throughput", 120, 120, "Megatron tokens/s and MFU -> train_calibration.json"),
    _spec("simulator_calibration", 60, 120, "rollpacker-simulate runs on the measured figures",
          needs=("decode", "train_throughput")),
    _spec("quantize_export", 150, 120, "rollout.quantization's sync step on the device: modelopt fp8 / int8 vs "
          "torch rounding, error bound, high-precision layers untouched, engine-format export"),
    _spec("push_memory", 90, 120, "push moment's peak memory (grads freed, weights woken, push, trainer offloaded, "
          "KV woken) vs the planner's moments and vs the earlier all-at-once order"),
]


_WHERE = {
    "model_setup": "megatron_parts", "cuda_ipc": "ipc_part", "push_pairing": "push_part", "nccl_groups": "megatron_parts",
    "bf16_train_step": "megatron_parts", "transformer_engine": "megatron_parts", "recompute": "megatron_parts",
    "offload": "memory_parts", "push_memory": "push_memory_part",
    "distributed_optimizer": "megatron_parts", "memory_estimator": "memory_parts",
    "decode": "perf_parts", "decode_cuda_graph": "perf_parts", "train_throughput": "perf_parts",
    "simulator_calibration": "perf_parts", "quantize_export": "quant_part",
}


def part_function(name: str) -> Callable:
    """The function that runs part ``name`` (its module is imported here: parts import torch)."""
    import importlib

    if name not in _WHERE:
        raise KeyError(f"unknown part {name!r}; parts: {', '.join(_WHERE)}")
    return getattr(importlib.import_module(f"{__package__}.{_WHERE[name]}"), name)

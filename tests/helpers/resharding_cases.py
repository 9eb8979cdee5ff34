"""Helpers for the resharding tests: vLLM's own weight loaders as the reference, and the SPMD
scenario run on gloo ranks.

Imported by spawned ranks (spawn start method): keep it free of pytest fixtures, and import
vLLM only inside :func:`vllm_reference_shard` (ranks never need it).
"""
from __future__ import annotations

import types
from pathlib import Path

import torch


def vllm_reference_shard(hf_dir: str, tp: int, rank: int, include_tied_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen2 layers hold on TP rank ``rank`` of ``tp`` after loading the HF checkpoint:
    the real QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear /
    VocabParallelEmbedding weight loaders run with vLLM's TP group faked to (rank, tp)."""
    from unittest import mock

    import vllm.distributed.parallel_state as vllm_ps
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    from vllm.config import VllmConfig, set_current_vllm_config

    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.training.weights_io import LazySafetensors

    arch, hf = read_qwen2_arch(hf_dir), LazySafetensors(hf_dir)
    h, d, f32 = arch.hidden_size, arch.head_dim, torch.float32
    out: dict[str, torch.Tensor] = {}
    group = types.SimpleNamespace(rank_in_group=rank, world_size=tp)
    with mock.patch.object(vllm_ps, "get_tp_group", return_value=group), set_current_vllm_config(VllmConfig()):
        def vocab(name: str, source: str, cls) -> None:
            layer = cls(arch.vocab_size, h, params_dtype=f32)
            layer.weight.data.fill_(float("nan"))  # the loader must write padding rows too
            layer.weight_loader(layer.weight, hf[source])
            out[name] = layer.weight.data.clone()

        vocab("model.embed_tokens.weight", "model.embed_tokens.weight", V.VocabParallelEmbedding)
        if not arch.tie_word_embeddings:
            vocab("lm_head.weight", "lm_head.weight", V.ParallelLMHead)
        elif include_tied_lm_head:
            vocab("lm_head.weight", "model.embed_tokens.weight", V.ParallelLMHead)
        out["model.norm.weight"] = hf["model.norm.weight"].clone()
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            qkv = L.QKVParallelLinear(h, d, arch.num_heads, arch.num_kv_heads, bias=True, params_dtype=f32)
            for kind in ("weight", "bias"):
                param = getattr(qkv, kind)
                for shard in ("q", "k", "v"):
                    qkv.weight_loader(param, hf[f"{p}self_attn.{shard}_proj.{kind}"], shard)
                out[f"{p}self_attn.qkv_proj.{kind}"] = param.data.clone()
            o = L.RowParallelLinear(arch.num_heads * d, h, bias=False, params_dtype=f32)
            o.weight_loader(o.weight, hf[f"{p}self_attn.o_proj.weight"])
            out[f"{p}self_attn.o_proj.weight"] = o.weight.data.clone()
            gu = L.MergedColumnParallelLinear(h, [arch.intermediate_size] * 2, bias=False, params_dtype=f32)
            gu.weight_loader(gu.weight, hf[f"{p}mlp.gate_proj.weight"], 0)
            gu.weight_loader(gu.weight, hf[f"{p}mlp.up_proj.weight"], 1)
            out[f"{p}mlp.gate_up_proj.weight"] = gu.weight.data.clone()
            down = L.RowParallelLinear(arch.intermediate_size, h, bias=False, params_dtype=f32)
            down.weight_loader(down.weight, hf[f"{p}mlp.down_proj.weight"])
            out[f"{p}mlp.down_proj.weight"] = down.weight.data.clone()
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"].clone()
    return out


def megatron_sources(hf_dir: str, layout, shards: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The Megatron shards (trainer ranks) ``shards`` of ``layout``, cut from the HF checkpoint."""
    from megatron_rl.model.hf_weights import hf_to_megatron_shard
    from megatron_rl.training.weights_io import LazySafetensors

    hf = LazySafetensors(hf_dir)
    out = {}
    for shard in shards:
        tp_rank, pp_rank, _ = layout.coords(shard)
        out[shard] = hf_to_megatron_shard(hf, layout.arch, tp_rank, layout.tp, pp_rank, layout.pp)
    return out


def reshard_scenarios(rank: int, world: int, port: int, cases: list[dict], expected_dir: str, bucket_bytes: int):
    """Each case: {model: HF dir, tp_t, pp_t, tp_r}.

    The trainer layout gets DP replicas up to ``world`` shards and the rollout layout engine
    replicas up to ``world`` shards (more shards than processes when TP x PP or TP_r exceeds
    the world). Trainer shard s lives on process s % world and rollout shard d on process
    (d + 1) % world, so some bytes are local copies and most cross processes. Returns, per
    case, this rank's mismatching tensors and its transfer stats."""
    import torch.distributed as dist

    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.resharding.execute import allocate_destinations, execute_plan
    from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout
    from megatron_rl.resharding.plan import build_plan
    from megatron_rl.resharding.transport import TorchDistributedTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    transport = TorchDistributedTransport()
    results = []
    for case in cases:
        arch = read_qwen2_arch(case["model"])
        model_parallel = case["tp_t"] * case["pp_t"]
        src = MegatronLayout(arch, case["tp_t"], case["pp_t"], max(1, world // model_parallel))
        dst = VLLMLayout(arch, case["tp_r"], max(1, world // case["tp_r"]))
        src_procs = [s % world for s in range(src.num_shards)]
        plan = build_plan(src, dst, src_procs, [(d + 1) % world for d in range(dst.num_shards)], bucket_bytes)
        mine = [s for s, proc in enumerate(src_procs) if proc == rank]
        sources = megatron_sources(case["model"], src, mine)
        dests = allocate_destinations(plan, rank, torch.float32)
        stats = execute_plan(plan, sources, dests, transport)
        mismatches = []
        for shard, tensors in dests.items():
            tp_rank = shard % case["tp_r"]
            ref = torch.load(Path(expected_dir) / f"{Path(case['model']).name}_tp{case['tp_r']}_r{tp_rank}.pt")
            if ref.keys() != tensors.keys():
                mismatches.append(f"keys differ: {sorted(ref.keys() ^ tensors.keys())}")
            mismatches += [f"shard {shard} {k}" for k in ref if k in tensors and not torch.equal(ref[k], tensors[k])]
        results.append({"case": case, "mismatches": mismatches, "dst_shards": sorted(dests),
                        "sent": stats.bytes_sent, "received": stats.bytes_received, "local": stats.bytes_local,
                        "plan_sent": plan.sent_numel * 4, "plan_local": plan.local_numel * 4,
                        "plan_dst": plan.dst_numel * 4, "max_bucket": max((b.numel for r in plan.rounds for b in r),
                                                                           default=0) * 4})
    dist.barrier()
    dist.destroy_process_group()
    return results


def trainer_from_converted(rank: int, world: int, port: int, hf_dir: str, converted: str, samples, ckpt_dir: str,
                           tp: int = 2, pp: int = 1):
    """A TP x PP MegatronWorker started from ``model.megatron_checkpoint``: its logprobs, its HF
    export, and a trainer checkpoint saved to ``ckpt_dir`` (rank 0 returns the results)."""
    import os

    from megatron_rl.config.schema import RunConfig
    from megatron_rl.training.megatron_worker import MegatronWorker

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.model.megatron_checkpoint = converted
    worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
    worker.load_hf(hf_dir)
    logprobs = worker.compute_logprobs(samples)
    weights = worker.export_hf_state_dict()
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    worker.save_checkpoint(ckpt_dir)
    torch.distributed.barrier()
    worker.shutdown()
    return {"logprobs": logprobs, "weights": weights} if rank == 0 else None


def rollout_shards_from_trainer(rank: int, world: int, port: int, hf_dirs: list[str], out_root: str,
                                rollout_tps: list[int]):
    """A Megatron TP2 x PP2 trainer writes its weights as vLLM rollout shards (policy version 7)
    for every TP in ``rollout_tps``, for each model in ``hf_dirs``, into
    ``out_root/<model dir name>/tp<N>``. Returns this rank's resharding stats per (model, TP)."""
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.training.megatron_worker import MegatronWorker

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.pipeline_model_parallel_size = 2
    worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
    stats = {}
    for hf_dir in hf_dirs:
        worker.load_hf(hf_dir)
        for tp in rollout_tps:
            target = f"{out_root}/{Path(hf_dir).name}/tp{tp}"
            stats[Path(hf_dir).name, tp] = worker.write_rollout_shards(tp, target, 7, "float32")
    # Writing the last directory again (version 8) replaces it as a whole.
    stats["again"] = worker.write_rollout_shards(tp, target, 8, "float32")
    worker.shutdown()
    return stats

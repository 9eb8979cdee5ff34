"""The trainer's weights as per-rank vLLM shards, moved by the resharder: how engines of a new
rollout TP get their weights after an elastic-TP switch.

Every trainer rank takes part (collective over the world group). The resharding plan
(:mod:`megatron_rl.resharding.plan`) moves Megatron's TP_t x PP_t (x DP) shards straight into
vLLM's TP_r parameter layout; each destination rank's tensors land on one trainer rank of the
engines' node ("writer"), spread round-robin so no rank holds the whole model. Writers save them
in vLLM's ``sharded_state`` format (``model-rank-{r}-part-0.safetensors``: exactly the tensors
of ``model.state_dict()`` of TP rank r), and rank 0 adds the HF config/tokenizer files and a
manifest naming the TP size and the policy version. An engine started on the directory with
``load_format="sharded_state"`` copies its rank's file into its parameters: no rank re-reads
or re-shards the full checkpoint (:class:`megatron_rl.rollout.actor.vllm_engine.VLLMEngine`).

The directory is replaced as a whole (built under a temp name, then renamed), like the HF
weight-sync directory, so an engine never sees half of it.
"""
from __future__ import annotations

import json
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import torch

from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.quantization.engine_format import attention_scale_params, write_model_files
from megatron_rl.quantization.scheme import QuantSpec, quantize_tensors
from megatron_rl.resharding.execute import ReshardStats, allocate_destinations, execute_plan
from megatron_rl.resharding.layouts import EMBED, LM_HEAD, MegatronLayout, VLLMLayout
from megatron_rl.resharding.plan import ReshardPlan, build_plan
from megatron_rl.runtime.files import replace_dir

MANIFEST = "rollout_shards.json"
FORMAT = "megatron_rl.rollout_shards/1"
SHARD_FILE = "model-rank-{rank}-part-0.safetensors"
# vLLM's unquantized attention registers these KV-cache scale buffers (value 1.0, float32, see
# ``set_default_quant_scales``); they are part of its state dict, and sharded_state loading
# refuses a file that lacks any state-dict entry.
ATTENTION_SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def engine_state_dict(tensors: Mapping[str, torch.Tensor], arch: Qwen2Arch,
                      quantization: QuantSpec | None = None) -> dict[str, torch.Tensor]:
    """One vLLM rank's resharded tensors (``VLLMLayout`` names) as its ``model.state_dict()``:

    * tied embeddings: vLLM's LM head *is* the embedding, and sharded_state keeps one name per
      storage, the smaller one, ``lm_head.weight``;
    * plus the attention scale buffers (see ``ATTENTION_SCALE_BUFFERS``);
    * ``quantization`` (rollout.quantization): the linear weights quantized per rank
      (``quantization.scheme.quantize_tensors``: low-precision weight + ``weight_scale``) and the
      quantized engine's KV-cache scale parameters.
    """
    out = {name: t.detach().to("cpu").contiguous() for name, t in quantize_tensors(tensors.items(), quantization)}
    if arch.tie_word_embeddings:
        out[LM_HEAD] = out.pop(EMBED)
    for layer in range(arch.num_layers):
        for buffer in ATTENTION_SCALE_BUFFERS:
            out[f"model.layers.{layer}.self_attn.attn.{buffer}"] = torch.tensor(1.0, dtype=torch.float32)
    if quantization is not None:
        out.update(attention_scale_params(arch.num_layers, quantization))
    return out


def writer_ranks(hostnames: list[str]) -> list[int]:
    """Trainer ranks on global rank 0's node, which is where the engines read from."""
    return [rank for rank, host in enumerate(hostnames) if host == hostnames[0]]


def read_rollout_manifest(directory: str | Path) -> dict | None:
    """The manifest of a rollout-shard directory, or None for a plain HF checkpoint directory.
    Raises ValueError naming the file when a manifest is there but the shards are incomplete."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    missing = [SHARD_FILE.format(rank=r) for r in range(int(manifest["tensor_parallel_size"]))
               if not (Path(directory) / SHARD_FILE.format(rank=r)).is_file()]
    if missing:
        raise ValueError(f"{path}: rollout shards missing: {missing}")
    return manifest


@dataclass(frozen=True)
class RolloutShardPlan:
    """What one rollout-shard write needs besides the tensors; the same for every write of a
    (trainer layout, rollout TP, dtype), so the trainer builds it once (:func:`plan_rollout_shards`)."""

    arch: Qwen2Arch
    """The model."""
    rollout_tp: int
    """TP size of the engines that load the files."""
    plan: ReshardPlan
    """Trainer shards -> one replica of vLLM TP ``rollout_tp`` shards."""
    writers: list[int]
    """Trainer ranks on rank 0's node; destination rank r is written by ``writers[r % len]``."""


def plan_rollout_shards(arch: Qwen2Arch, trainer: MegatronLayout, rollout_tp: int, transport,
                        dtype: torch.dtype, bucket_bytes: int = 256 << 20) -> RolloutShardPlan:
    """Collective over ``transport``'s group (the trainer world, rank = Megatron global rank):
    find the writer ranks (rank 0's node) and build the resharding plan.

    ``trainer``: shard index = global rank (Megatron's tp-cp-dp-pp order with CP folded into DP,
    since weights are replicated over CP)."""
    world = torch.distributed.get_world_size(transport.group)
    if trainer.num_shards != world:
        raise ValueError(f"write_rollout_shards: trainer layout has {trainer.num_shards} shards but the group "
                         f"has {world} ranks")
    hostnames: list = [None] * world
    torch.distributed.all_gather_object(hostnames, socket.gethostname(), group=transport.group)
    writers = writer_ranks(hostnames)
    plan = build_plan(trainer, VLLMLayout(arch, rollout_tp), list(range(world)),
                      [writers[r % len(writers)] for r in range(rollout_tp)], bucket_bytes,
                      torch.empty((), dtype=dtype).element_size())
    return RolloutShardPlan(arch, rollout_tp, plan, writers)


def write_rollout_shards(
    sources: Mapping[str, torch.Tensor],
    shard_plan: RolloutShardPlan,
    directory: str | Path,
    *,
    hf_path: str | Path,
    version: int,
    transport,
    dtype: torch.dtype,
    quantization: QuantSpec | None = None,
) -> ReshardStats:
    """Collective over ``transport``'s group (the group the plan was built on).

    Args:
        sources: this rank's local tensors (Megatron local-spec names, e.g. the model's state dict).
        shard_plan: from :func:`plan_rollout_shards` with the same dtype.
        directory: the directory to (re)place; on rank 0's node.
        hf_path: HF checkpoint whose config and tokenizer files go along.
        version: policy version of these weights (recorded in the manifest; engines tag their
            completions with it).
        transport: :class:`~megatron_rl.resharding.transport.TorchDistributedTransport`.
        dtype: dtype of the message buffers and of the written tensors (the engine's dtype).
        quantization: rollout.quantization's spec, or None: each writer quantizes its ranks'
            linear weights before saving (the resharder moves ``dtype`` bytes), and the
            directory's config.json carries the engine's ``quantization_config``.

    Returns this rank's :class:`ReshardStats` (bytes sent/received/copied locally, seconds).
    """
    rank, plan, arch = transport.rank, shard_plan.plan, shard_plan.arch
    target = Path(directory)
    tmp = target.parent / f".{target.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    transport.barrier()  # the temp dir exists before anyone writes into it

    destinations = allocate_destinations(plan, rank, dtype, transport.device())
    stats = execute_plan(plan, {rank: sources}, destinations, transport, dtype=dtype)
    from safetensors.torch import save_file

    for shard, tensors in destinations.items():
        save_file(engine_state_dict(tensors, arch, quantization), str(tmp / SHARD_FILE.format(rank=shard)),
                  metadata={"format": "pt"})
    del destinations
    transport.barrier()  # every shard file is complete
    if rank == 0:
        write_model_files(hf_path, tmp, quantization)
        manifest = {"format": FORMAT, "tensor_parallel_size": shard_plan.rollout_tp, "version": version,
                    "dtype": str(dtype).removeprefix("torch."), "hf_path": str(hf_path),
                    "quantization": quantization.method if quantization is not None else "none",
                    "writers": shard_plan.writers,
                    "bytes_moved": (plan.sent_numel + plan.local_numel) * torch.empty((), dtype=dtype).element_size()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        replace_dir(tmp, target)
    transport.barrier()  # the directory is in place before any rank returns
    return stats


def stats_dict(stats: ReshardStats) -> dict[str, float]:
    """ReshardStats as plain numbers (to cross Ray)."""
    return {k: float(v) for k, v in asdict(stats).items()}

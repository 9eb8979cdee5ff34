"""Weights in and out of a Megatron Qwen2 model: HF safetensors -> this rank's shard, and all
ranks' shards -> one full HF state dict (on global rank 0).

The conversion itself is pure (``megatron_rl.model.hf_weights``); this module adds the file
reading and the collectives.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_rl.model.hf_weights import (
    from_te_names,
    hf_to_megatron_shard,
    megatron_stage_to_hf,
    to_te_names,
)
from megatron_rl.model.qwen2 import Qwen2Arch


class LazySafetensors(Mapping):
    """Read-only mapping over an HF checkpoint's safetensors files; a tensor is read on access.

    Each rank only reads the tensors its shard needs instead of materialising the whole model.
    """

    def __init__(self, hf_path: str | Path) -> None:
        root = Path(hf_path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: root / fname for name, fname in weight_map.items()}
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model.hf_path: no *.safetensors files in {root}")
            from safetensors import safe_open

            self._where = {}
            for path in files:
                with safe_open(str(path), framework="pt") as handle:
                    self._where.update({name: path for name in handle.keys()})

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise KeyError(name)
        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP and Float16Module both keep the wrapped model in .module.
    while hasattr(model, "module"):
        model = model.module
    return model


def _uses_te_names(state: Mapping[str, torch.Tensor]) -> bool:
    return any(name.endswith("layer_norm_weight") for name in state)


def load_hf_into_model(
    model: torch.nn.Module,
    hf_path: str | Path,
    arch: Qwen2Arch,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
) -> None:
    """Copy this rank's shard of the HF checkpoint into ``model`` (in place, any dtype).

    Every parameter of the model must be covered: a missing or unexpected key is an error
    naming it (only Transformer Engine's ``_extra_state`` entries are skipped).
    """
    shard = hf_to_megatron_shard(LazySafetensors(hf_path), arch, tp_rank, tp_size, pp_rank, pp_size)
    target = _unwrap(model).state_dict()
    if _uses_te_names(target):
        shard = to_te_names(shard)
    wanted = {name for name in target if not name.endswith("_extra_state")}
    missing, unexpected = wanted - shard.keys(), shard.keys() - wanted
    if missing or unexpected:
        raise KeyError(
            f"{hf_path}: HF->Megatron shard (tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}) does not match "
            f"the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    with torch.no_grad():
        for name, tensor in shard.items():
            if target[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target[name].shape)}")
            target[name].copy_(tensor)


def local_tensors(
    model: torch.nn.Module, pick: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None
) -> dict[str, torch.Tensor]:
    """Local-spec-named tensors of this rank: parameters by default, or ``pick(param)`` (e.g. the
    gradient buffer ``param.main_grad``), detached, fp32 copies on the CPU."""
    return {n: t.float().cpu().clone() for n, t in local_views(model, pick).items()}


def local_views(
    model: torch.nn.Module, pick: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None
) -> dict[str, torch.Tensor]:
    """Like :func:`local_tensors` but detached views on the model's device and dtype (no copy)."""
    inner = _unwrap(model)
    if pick is None:
        state = {n: t for n, t in inner.state_dict().items() if not n.endswith("_extra_state")}
    else:
        state = {n: pick(p) for n, p in inner.named_parameters()}
        state = {n: t for n, t in state.items() if t is not None}
    return {n: t.detach() for n, t in from_te_names(state).items()}


def gather_hf_state_dict(
    tensors: dict[str, torch.Tensor], arch: Qwen2Arch, include_tied_lm_head: bool = True
) -> dict[str, torch.Tensor] | None:
    """Collect every rank's ``tensors`` (see :func:`local_tensors`) into a full HF state dict on
    global rank 0; returns None elsewhere. Collective: call on all ranks.

    Only DP rank 0 contributes (replicas are identical). Within a stage the TP shards go to TP
    rank 0, which converts them to HF names; stages then send to PP rank 0 (global rank 0).
    """
    from megatron.core import parallel_state as ps

    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    if ps.get_data_parallel_rank() != 0:
        return None
    tp_shards: list = [None] * tp_size if tp_rank == 0 else None
    torch.distributed.gather_object(
        tensors, tp_shards, dst=torch.distributed.get_global_rank(tp_group, 0), group=tp_group
    )
    if tp_rank != 0:
        return None
    stage = megatron_stage_to_hf(tp_shards, arch, pp_rank, pp_size)
    stages: list = [None] * pp_size if pp_rank == 0 else None
    torch.distributed.gather_object(
        stage, stages, dst=torch.distributed.get_global_rank(pp_group, 0), group=pp_group
    )
    if pp_rank != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in stages:
        out.update(part)
    if include_tied_lm_head and arch.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out

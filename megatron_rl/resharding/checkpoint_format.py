"""On-disk Megatron model checkpoints: the converter's per-(TP, PP) format and the trainer's own
per-rank checkpoints.

Converted format (``tools/convert_checkpoint.py hf-to-megatron``), one directory::

    megatron_meta.json          {"format": FORMAT, "tensor_model_parallel_size": T,
                                 "pipeline_model_parallel_size": P, "dtype": "float32"}
    model_tp{t:02d}_pp{p:02d}.pt  Megatron local-spec state dict of shard (t, p) (torch.save)
    config.json, tokenizer files  copied from the HF checkpoint (the architecture lives here)

Weights only, no optimizer: it is a starting point (``model.megatron_checkpoint``), not a resume
point. ``megatron.core.dist_checkpointing`` is not used: it needs a built model and process
groups on every rank, while this format is written offline by one process and read by each
trainer rank for its own (TP, PP) coordinates, whatever the DP size.

Trainer checkpoints (``MegatronWorker.save_checkpoint``) hold ``megatron_rank{r:05d}.pt`` per
rank with the wrapped model's state dict, the ``ParallelLayout`` and the world size;
:func:`read_trainer_checkpoint` extracts DP rank 0's model shards from them.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from megatron_rl.model.hf_weights import from_te_names, to_te_names

FORMAT = "megatron_rl.model_shards/v1"
META = "megatron_meta.json"
StateDict = dict[str, torch.Tensor]
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def shard_file(directory: str | Path, tp_rank: int, pp_rank: int) -> Path:
    """Path of shard (tp_rank, pp_rank) in a converted checkpoint."""
    return Path(directory) / f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy config, generation config and tokenizer files (whichever exist) from ``src``."""
    for name in _HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def write_shard(directory: str | Path, tp_rank: int, pp_rank: int, state: StateDict) -> None:
    """Write shard (tp_rank, pp_rank) (local-spec names) into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in state.items()}, shard_file(directory, tp_rank, pp_rank))


def write_meta(directory: str | Path, tp: int, pp: int, dtype: str) -> None:
    """Write the metadata file. Call it last: until it exists the directory is not a checkpoint,
    so an interrupted conversion is never mistaken for a complete one."""
    meta = {"format": FORMAT, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "dtype": dtype}
    (Path(directory) / META).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(directory: str | Path) -> dict:
    """The metadata of a converted checkpoint; errors name the directory and what is wrong."""
    path = Path(directory) / META
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {META}; not a checkpoint written by tools/convert_checkpoint.py")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_converted_shard(directory: str | Path, tp_rank: int, pp_rank: int, tp: int, pp: int) -> StateDict:
    """Shard (tp_rank, pp_rank) of a converted checkpoint written for exactly (tp, pp)."""
    meta = read_meta(directory)
    have = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"])
    if have != (tp, pp):
        raise ValueError(
            f"model.megatron_checkpoint {directory} was converted for TP={have[0]}, PP={have[1]} but the trainer "
            f"runs TP={tp}, PP={pp}; convert again with --tp {tp} --pp {pp}")
    path = shard_file(directory, tp_rank, pp_rank)
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: missing {path.name}")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_all_converted(directory: str | Path) -> tuple[dict[tuple[int, int], StateDict], int, int]:
    """Every shard of a converted checkpoint, keyed (tp_rank, pp_rank), with (TP, PP)."""
    meta = read_meta(directory)
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    shards = {(t, p): read_converted_shard(directory, t, p, tp, pp) for t in range(tp) for p in range(pp)}
    return shards, tp, pp


def _strip_wrappers(state: dict) -> StateDict:
    """DDP / Float16Module prefix ``module.`` removed, TE names mapped to local ones, TE extra
    state and non-tensors dropped."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        out[re.sub(r"^(module\.)+", "", name)] = value.float()
    return from_te_names(out)


def read_trainer_checkpoint(directory: str | Path) -> tuple[dict[tuple[int, int], StateDict], int, int]:
    """DP rank 0's model shards of a trainer checkpoint (``megatron_rank*.pt``), keyed
    (tp_rank, pp_rank), with (TP, PP). Megatron's rank order is tp-cp-ep-dp-pp."""
    files = sorted(Path(directory).glob("megatron_rank*.pt"))
    if not files:
        raise FileNotFoundError(f"{directory}: no megatron_rank*.pt (not a trainer checkpoint)")
    first = torch.load(files[0], map_location="cpu", weights_only=False)
    layout, world = first["layout"], first["world_size"]
    tp, pp, cp = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.context_parallel_size)
    dp = world // (tp * pp * cp)
    shards = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = tp_rank + tp * cp * dp * pp_rank  # cp_rank = dp_rank = 0
            path = Path(directory) / f"megatron_rank{rank:05d}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"{directory}: missing {path.name} (tp {tp_rank}, pp {pp_rank})")
            state = first if path == files[0] else torch.load(path, map_location="cpu", weights_only=False)
            shards[(tp_rank, pp_rank)] = _strip_wrappers(state["model"])
    return shards, tp, pp


def load_shard_into_model(model: torch.nn.Module, shard: StateDict, label: str) -> None:
    """Copy a local-spec shard into a (possibly wrapped, possibly TE-spec) Megatron model;
    every parameter must be covered (``label`` names the source in errors)."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    target = inner.state_dict()
    if any(name.endswith("layer_norm_weight") for name in target):
        shard = to_te_names(shard)
    wanted = {name for name in target if not name.endswith("_extra_state")}
    missing, unexpected = wanted - shard.keys(), shard.keys() - wanted
    if missing or unexpected:
        raise KeyError(f"{label}: shard does not match the model: missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if target[name].shape != tensor.shape:
                raise ValueError(f"{label}: {name} has shape {tuple(tensor.shape)}, model {tuple(target[name].shape)}")
            target[name].copy_(tensor)

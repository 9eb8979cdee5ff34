"""On-disk Megatron model checkpoints: Megatron's dist_checkpointing format, read and written
offline, plus read-only support for this project's two LEGACY formats.

Current format: a ``megatron.core.dist_checkpointing`` (torch_dist) checkpoint, which stores
global tensors and so loads at any TP / PP / DP. Two kinds of directories hold one:

* converted (``megatron-rl-convert-checkpoint hf-to-megatron``), weights only::

      metadata.json, .metadata, __0_0.distcp, common.pt   the dist checkpoint (GPTModel keys)
      megatron_meta.json    {"format": FORMAT, "dtype": ...}, written last: until it exists
                            the directory is not a finished conversion
      config.json, tokenizer files   copied from the HF checkpoint (the architecture lives here)

* a trainer step directory ``run_dir/checkpoints/step_N`` with the dist checkpoint in
  ``megatron/`` (model, reference, optimizer, RNG; ``megatron_rl/training/dist_checkpoint.py``).

Both carry the policy under the same keys (``GPTModel.sharded_state_dict()``), so either can be
``model.megatron_checkpoint`` or the input of ``megatron-to-hf``. Offline, in one process
without GPUs, :func:`write_model_checkpoint` and :func:`read_model_checkpoint` take the sharded
state dict from a TP1/PP1 GPTModel built on the meta device (no memory) in a private
single-process world, so the keys, the layer stacking and the QKV / gate-up sharding rules are
Megatron's own; the tensors in between are the full TP1 ones of ``hf_to_megatron_shard``.
Memory: the whole model once, in its dtype.

LEGACY formats (read only; new checkpoints never use them):

* ``megatron_rl.model_shards/v1`` converted checkpoints: ``megatron_meta.json`` with TP/PP and
  ``model_tp{t:02d}_pp{p:02d}.pt`` per shard (the old ``hf-to-megatron``); they load only at the
  TP/PP they were converted for (:func:`read_converted_shard`).
* per-rank trainer checkpoints: ``megatron_rank{r:05d}.pt`` per rank
  (``megatron_rl/training/legacy_checkpoint.py``); :func:`read_trainer_checkpoint` extracts DP
  rank 0's model shards from them for ``megatron-to-hf``.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_rl.model.hf_weights import from_te_names, to_te_names
from megatron_rl.model.qwen2 import Qwen2Arch

FORMAT = "megatron_rl.dist_checkpoint/v2"
LEGACY_FORMAT = "megatron_rl.model_shards/v1"
META = "megatron_meta.json"
TRAINER_SUBDIR = "megatron"
"""Where a trainer step directory keeps its dist checkpoint."""
StateDict = dict[str, torch.Tensor]
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy config, generation config and tokenizer files (whichever exist) from ``src``."""
    for name in _HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def write_meta(directory: str | Path, dtype: str) -> None:
    """Write the metadata file of a converted checkpoint. Call it last: until it exists the
    directory is not a checkpoint, so an interrupted conversion is never mistaken for one."""
    meta = {"format": FORMAT, "dtype": dtype}
    (Path(directory) / META).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(directory: str | Path) -> dict:
    """The metadata of a converted checkpoint (current or legacy format); errors name the
    directory and what is wrong."""
    path = Path(directory) / META
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {META}; not a checkpoint written by megatron-rl-convert-checkpoint")
    meta = json.loads(path.read_text())
    if meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} (or the legacy {LEGACY_FORMAT!r})")
    return meta


def is_legacy_converted(directory: str | Path) -> bool:
    """True for a LEGACY per-(TP, PP) converted checkpoint."""
    path = Path(directory) / META
    return path.is_file() and json.loads(path.read_text()).get("format") == LEGACY_FORMAT


def find_dist_checkpoint(directory: str | Path) -> Path:
    """The dist checkpoint in ``directory``: the directory itself (a converted checkpoint) or its
    ``megatron/`` sub-directory (a trainer step directory). Raises ``CheckpointError`` naming
    what is wrong (nothing there, an interrupted save, a legacy format)."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    from megatron_rl.checkpoint.store import CheckpointError

    path = Path(directory)
    for candidate in (path, path / TRAINER_SUBDIR):
        if candidate.is_dir() and check_is_distributed_checkpoint(str(candidate)):
            return candidate
    if (path / TRAINER_SUBDIR).is_dir():
        raise CheckpointError(f"{path / TRAINER_SUBDIR} has no metadata.json: the save that wrote it was interrupted")
    if any(path.glob("megatron_rank*.pt")):
        raise CheckpointError(f"{path} is a legacy per-rank trainer checkpoint (megatron_rank*.pt), not a dist "
                              "checkpoint: resume it at the layout that wrote it (trainer.resume) and save again")
    if is_legacy_converted(path):
        raise CheckpointError(f"{path} is a legacy {LEGACY_FORMAT} conversion: convert the HF checkpoint again "
                              "with megatron-rl-convert-checkpoint hf-to-megatron (one output loads at any layout)")
    raise CheckpointError(f"{path} is not a dist checkpoint (no metadata.json in it or in {TRAINER_SUBDIR}/)")


# --------------------------------------------------------------------------- offline access
@contextlib.contextmanager
def _offline_megatron() -> Iterator[None]:
    """A torch.distributed world of this one process (gloo, in-memory store) with Megatron's
    TP1/PP1 parallel state, torn down afterwards.

    Without a GPU, the two CUDA calls the torch_dist writer makes (``torch.cuda.synchronize`` and
    ``torch.cuda.current_device`` as a tensor device) are pointed at the CPU for the duration and
    restored afterwards, instead of applying the process-wide CPU shim: the caller's process (a
    test that later hosts vLLM, say) is left as it was."""
    from megatron.core import parallel_state as ps

    from megatron_rl.distributed.cpu_shim import cpu_device_mode

    made_world = not torch.distributed.is_initialized()
    if made_world:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    elif torch.distributed.get_world_size() != 1:
        raise RuntimeError("offline checkpoint conversion runs in one process, not inside a distributed job")
    made_parallel = not ps.model_parallel_is_initialized()
    if made_parallel:
        ps.initialize_model_parallel(1, 1)
    saved = torch.cuda.synchronize, torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        with cpu_device_mode():
            yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        if made_parallel:
            ps.destroy_model_parallel()
        if made_world:
            torch.distributed.destroy_process_group()


def _template(arch: Qwen2Arch, dtype: torch.dtype) -> dict:
    """Sharded state dict of a TP1/PP1 local-spec GPTModel on the meta device (call inside
    :func:`_offline_megatron`)."""
    from megatron_rl.model.qwen2 import build_gpt_model, build_transformer_config

    name = next(k for k, v in _DTYPES.items() if v == dtype)
    config = build_transformer_config(arch, name, 1, 1)
    config.perform_initialization = False
    with torch.device("meta"):
        model = build_gpt_model(arch, config, 1, pre_process=True, post_process=True, transformer_impl="local")
    return model.sharded_state_dict()


def _tensor_entries(template: dict) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {k: v for k, v in template.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}


def write_model_checkpoint(directory: str | Path, arch: Qwen2Arch, tensors: StateDict) -> None:
    """Write a full TP1/PP1 local-spec state dict (``hf_to_megatron_shard(..., 0, 1, 0, 1)``) as
    a dist checkpoint into ``directory`` (created; must not hold another checkpoint)."""
    from megatron.core import dist_checkpointing

    dtype = next(iter(tensors.values())).dtype
    Path(directory).mkdir(parents=True, exist_ok=True)
    with _offline_megatron():
        template = _template(arch, dtype)
        entries = _tensor_entries(template)
        if entries.keys() != tensors.keys():
            raise KeyError(f"{directory}: tensors do not match the model: missing {sorted(entries.keys() - tensors.keys())}, "
                           f"unexpected {sorted(tensors.keys() - entries.keys())}")
        for name, entry in entries.items():
            if tuple(entry.data.shape) != tuple(tensors[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, the model has {tuple(entry.data.shape)}")
            entry.data = tensors[name].contiguous()
        dist_checkpointing.save(template, str(directory))


def checkpoint_dtype(directory: str | Path) -> torch.dtype:
    """dtype of the word embeddings in a dist checkpoint (the weights' dtype)."""
    from megatron.core import dist_checkpointing

    with _offline_megatron():
        meta = dist_checkpointing.load_tensors_metadata(str(find_dist_checkpoint(directory)))
    return meta["embedding.word_embeddings.weight"].dtype


def read_model_checkpoint(directory: str | Path, arch: Qwen2Arch) -> StateDict:
    """The policy weights of a converted checkpoint or trainer step directory as one full
    TP1/PP1 local-spec state dict (vocabulary padded for TP1), in the checkpoint's dtype."""
    from megatron.core import dist_checkpointing

    source = find_dist_checkpoint(directory)
    dtype = checkpoint_dtype(source)
    with _offline_megatron():
        template = _template(arch, dtype)
        for entry in _tensor_entries(template).values():
            entry.data = torch.empty(entry.data.shape, dtype=dtype)
        template = {k: v for k, v in template.items() if not k.endswith("_extra_state")}
        loaded = dist_checkpointing.load(template, str(source))
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------- LEGACY formats
def shard_file(directory: str | Path, tp_rank: int, pp_rank: int) -> Path:
    """LEGACY: path of shard (tp_rank, pp_rank) in a v1 converted checkpoint."""
    return Path(directory) / f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def read_converted_shard(directory: str | Path, tp_rank: int, pp_rank: int, tp: int, pp: int) -> StateDict:
    """LEGACY: shard (tp_rank, pp_rank) of a v1 converted checkpoint written for exactly (tp, pp)."""
    meta = read_meta(directory)
    if meta["format"] != LEGACY_FORMAT:
        raise ValueError(f"{directory} is a {meta['format']} checkpoint, not the legacy per-shard format")
    have = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"])
    if have != (tp, pp):
        raise ValueError(
            f"model.megatron_checkpoint {directory} (legacy {LEGACY_FORMAT}) was converted for TP={have[0]}, "
            f"PP={have[1]} but the trainer runs TP={tp}, PP={pp}; convert the HF checkpoint again with "
            "megatron-rl-convert-checkpoint hf-to-megatron (its output loads at any layout)")
    path = shard_file(directory, tp_rank, pp_rank)
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: missing {path.name}")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_all_converted(directory: str | Path) -> tuple[dict[tuple[int, int], StateDict], int, int]:
    """LEGACY: every shard of a v1 converted checkpoint, keyed (tp_rank, pp_rank), with (TP, PP)."""
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
    """LEGACY: DP rank 0's model shards of a per-rank trainer checkpoint (``megatron_rank*.pt``),
    keyed (tp_rank, pp_rank), with (TP, PP). Megatron's rank order is tp-cp-ep-dp-pp."""
    files = sorted(Path(directory).glob("megatron_rank*.pt"))
    if not files:
        raise FileNotFoundError(f"{directory}: no megatron_rank*.pt (not a legacy trainer checkpoint)")
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
    """LEGACY: copy a local-spec shard into a (possibly wrapped, possibly TE-spec) Megatron model;
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

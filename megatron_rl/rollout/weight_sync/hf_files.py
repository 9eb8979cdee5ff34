"""The HF file format of the weight sync (``rollout.weight_sync_format=hf``): the trainer writes
HF-named safetensors, the engine reloads them in place; and the dtype engines run in (what every
format writes).

The directory is replaced as a whole (write to a sibling temp dir, then rename) so a reader never
sees half a checkpoint.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Mapping

import torch

from megatron_rl.runtime.files import replace_dir

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


def _with_lm_head(
    state_dict: Mapping[str, torch.Tensor], tie_word_embeddings: bool | None
) -> dict[str, torch.Tensor]:
    """Add lm_head.weight for tied models.

    vLLM's in-place reload keeps a separate (repacked) lm_head on CPU even when embeddings are
    tied; leaving the key out "succeeds" but leaves the old head in place (stale logprobs).
    """
    tensors = dict(state_dict)
    if LM_HEAD_KEY in tensors:
        return tensors
    if tie_word_embeddings is False:
        raise KeyError(f"{LM_HEAD_KEY!r} missing from the state dict of an untied model")
    if EMBED_KEY not in tensors:
        raise KeyError(f"neither {LM_HEAD_KEY!r} nor {EMBED_KEY!r} in the state dict; cannot write an output layer")
    tensors[LM_HEAD_KEY] = tensors[EMBED_KEY]
    return tensors


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into shards of at most ``max_shard_bytes`` (a single larger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_hf_weights(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    tie_word_embeddings: bool | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write an HF-named state dict as safetensors into ``directory``, replacing it atomically.

    Args:
        state_dict: Hugging Face parameter names -> tensors (any device; copied to CPU).
        directory: target directory; an existing one is replaced as a whole.
        tie_word_embeddings: True/None: a missing ``lm_head.weight`` is written as a copy of
            the embedding; False: a missing ``lm_head.weight`` is an error.
        max_shard_bytes: shard size; with more than one shard a
            ``model.safetensors.index.json`` is written like ``save_pretrained`` does.

    Returns the directory path.
    """
    from safetensors.torch import save_file

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = _with_lm_head(state_dict, tie_word_embeddings)
    cpu: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (tied weights): copy repeats.
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        cpu[name] = t

    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards = _shards(cpu, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in cpu.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, target)
    return target


def engine_dtype(hf_path: str | Path, on_gpu: bool) -> str:
    """The dtype VLLMEngine runs a model in, so the dtype to write its weights in: float32 on
    CPU, the checkpoint's dtype on GPU (vLLM's 'auto')."""
    if not on_gpu:
        return "float32"
    config = json.loads((Path(hf_path) / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype") or "bfloat16"

"""Convert Qwen2/Qwen2.5 checkpoints between Hugging Face and Megatron's dist_checkpointing format.

    megatron-rl-convert-checkpoint hf-to-megatron --hf DIR --out DIR [--dtype D]
    megatron-rl-convert-checkpoint megatron-to-hf --megatron DIR --out DIR [--hf-config DIR]

``hf-to-megatron`` writes a ``megatron.core.dist_checkpointing`` (torch_dist) checkpoint of the
weights plus config and tokenizer (``megatron_rl/resharding/checkpoint_format.py``). It holds
global tensors, so one conversion loads at any trainer layout: point ``model.megatron_checkpoint``
at it whatever ``parallel.*`` is. ``--tp`` / ``--pp`` are deprecated (the output no longer
depends on them); when given they are only checked against the architecture, with a warning.

``megatron-to-hf`` reads such a directory, one of the trainer's checkpoints
(``run_dir/checkpoints/step_*``, which hold no config: pass ``--hf-config`` = the run's
``model.hf_path`` for config.json and the tokenizer), or either LEGACY format (per-(TP, PP)
conversions, per-rank trainer checkpoints). It writes safetensors (files of at most
``--max-shard-gb``, with ``model.safetensors.index.json`` when there are several), config.json and
the tokenizer files, which transformers and vLLM load directly. Tied models get no
``lm_head.weight``, as in Qwen's releases.

Memory: the whole model once in its dtype (plus one converted copy). HF -> Megatron -> HF is
bit-exact (same dtype in and out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard, megatron_stage_to_hf
from megatron_rl.model.qwen2 import check_parallel_fits, read_qwen2_arch
from megatron_rl.resharding import checkpoint_format as fmt
from megatron_rl.training.weights_io import LazySafetensors

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What an earlier conversion may have left in the output directory (replaced, never mixed in).
_STALE = ("metadata.json", ".metadata", "common.pt", "*.distcp", "model_tp*_pp*.pt")


def hf_to_megatron(hf_dir: str, out_dir: str, tp: int | None = None, pp: int | None = None,
                   dtype: str = "auto") -> Path:
    """Convert an HF Qwen2 checkpoint into a layout-independent dist checkpoint in ``out_dir``;
    returns the output directory. ``tp`` / ``pp`` are deprecated (see the module docstring)."""
    arch = read_qwen2_arch(hf_dir)
    if tp is not None or pp is not None:
        warnings.warn("convert_checkpoint.py --tp/--pp are deprecated: the dist checkpoint loads at any layout; "
                      "they are only checked against the architecture", FutureWarning, stacklevel=2)
        check_parallel_fits(arch, tp or 1, pp or 1)
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    tensors = hf_to_megatron_shard(LazySafetensors(hf_dir), arch, 0, 1, 0, 1)
    if _DTYPES[dtype] is not None:
        tensors = {k: v.to(_DTYPES[dtype]) for k, v in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / fmt.META).unlink(missing_ok=True)  # invalid until the new checkpoint is complete
    for pattern in _STALE:
        for path in out.glob(pattern):
            path.unlink()
    fmt.write_model_checkpoint(out, arch, tensors)
    fmt.copy_hf_side_files(hf_dir, out)
    fmt.write_meta(out, dtype=str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    return out


def _read_as_hf(src: Path, side: str) -> dict[str, torch.Tensor]:
    """HF-named tensors of a dist or legacy checkpoint directory."""
    arch = read_qwen2_arch(side)
    if fmt.is_legacy_converted(src) or any(src.glob("megatron_rank*.pt")):
        reader = fmt.read_all_converted if fmt.is_legacy_converted(src) else fmt.read_trainer_checkpoint
        shards, tp, pp = reader(src)
        out: dict[str, torch.Tensor] = {}
        for pp_rank in range(pp):
            out.update(megatron_stage_to_hf([shards.pop((t, pp_rank)) for t in range(tp)], arch, pp_rank, pp))
        return out
    return megatron_stage_to_hf([fmt.read_model_checkpoint(src, arch)], arch, 0, 1)


def _write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """HF's file layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of
    at most ``max_shard_bytes`` (a bigger tensor gets a file of its own) plus the index."""
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def megatron_to_hf(megatron_dir: str, out_dir: str, hf_config: str | None = None,
                   max_shard_gb: float = 5.0) -> Path:
    """Export a converted or trainer checkpoint (either format) as an HF checkpoint; returns
    the output directory."""
    src = Path(megatron_dir)
    side = hf_config or (str(src) if (src / "config.json").is_file() else None)
    if side is None:
        raise ValueError(f"{src} is a trainer checkpoint (no config.json): pass --hf-config DIR "
                         "(the run's model.hf_path) for config.json and the tokenizer")
    state = _read_as_hf(src, side)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(state, out, int(max_shard_gb * 1024**3))
    fmt.copy_hf_side_files(side, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_m = sub.add_parser("hf-to-megatron", help="HF checkpoint -> Megatron dist checkpoint (any layout)")
    to_m.add_argument("--hf", required=True, help="HF Qwen2/Qwen2.5 checkpoint directory")
    to_m.add_argument("--out", required=True, help="output directory")
    to_m.add_argument("--tp", type=int, default=None, help="deprecated: the output loads at any TP (only checked)")
    to_m.add_argument("--pp", type=int, default=None, help="deprecated: the output loads at any PP (only checked)")
    to_m.add_argument("--dtype", default="auto", choices=sorted(_DTYPES), help="cast weights (auto: keep)")
    to_h = sub.add_parser("megatron-to-hf", help="Megatron or trainer checkpoint -> HF checkpoint")
    to_h.add_argument("--megatron", required=True, help="converted or trainer checkpoint (step) directory")
    to_h.add_argument("--out", required=True, help="output directory")
    to_h.add_argument("--hf-config", default=None, help="HF dir with config.json + tokenizer (trainer checkpoints)")
    to_h.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.command == "hf-to-megatron":
        if args.tp is not None or args.pp is not None:
            print("hf-to-megatron: --tp/--pp are deprecated and no longer shape the output (it loads at any layout)")
        out = hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.dtype)
    else:
        out = megatron_to_hf(args.megatron, args.out, args.hf_config, args.max_shard_gb)
    print(f"{args.command}: wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

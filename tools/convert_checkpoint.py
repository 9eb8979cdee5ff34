"""Convert Qwen2/Qwen2.5 checkpoints between Hugging Face and Megatron (TP, PP) shards.

    python tools/convert_checkpoint.py hf-to-megatron --hf DIR --out DIR --tp N --pp M [--dtype D]
    python tools/convert_checkpoint.py megatron-to-hf --megatron DIR --out DIR [--hf-config DIR]

``hf-to-megatron`` writes the per-(TP, PP) shard format of
``megatron_rl/resharding/checkpoint_format.py`` (weights + config + tokenizer); point
``model.megatron_checkpoint`` at it to start training from it (the trainer's TP/PP must match).

``megatron-to-hf`` reads either such a directory or one of the trainer's own checkpoints
(``run_dir/checkpoints/step_*``, which hold no config: pass ``--hf-config`` = the run's
``model.hf_path`` for config.json and the tokenizer) and writes safetensors (one file per
pipeline stage plus ``model.safetensors.index.json``), config.json and the tokenizer files, which
transformers and vLLM load directly. Tied models get no ``lm_head.weight``, as in Qwen's releases.

Memory: hf-to-megatron holds one shard at a time; megatron-to-hf one pipeline stage at a time.
HF -> Megatron -> HF is bit-exact (same dtype in and out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_rl.model.hf_weights import hf_to_megatron_shard, megatron_stage_to_hf  # noqa: E402
from megatron_rl.model.qwen2 import check_parallel_fits, read_qwen2_arch  # noqa: E402
from megatron_rl.resharding import checkpoint_format as fmt  # noqa: E402
from megatron_rl.training.weights_io import LazySafetensors  # noqa: E402

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_to_megatron(hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str = "auto") -> Path:
    """Shard an HF Qwen2 checkpoint for Megatron (TP, PP); returns the output directory."""
    arch = read_qwen2_arch(hf_dir)
    check_parallel_fits(arch, tp, pp)
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    hf = LazySafetensors(hf_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / fmt.META).unlink(missing_ok=True)  # invalid until the new shards are all written
    seen_dtype = None
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = hf_to_megatron_shard(hf, arch, tp_rank, tp, pp_rank, pp)
            if _DTYPES[dtype] is not None:
                shard = {k: v.to(_DTYPES[dtype]) for k, v in shard.items()}
            seen_dtype = next(iter(shard.values())).dtype
            fmt.write_shard(out, tp_rank, pp_rank, shard)
    fmt.copy_hf_side_files(hf_dir, out)
    fmt.write_meta(out, tp, pp, dtype=str(seen_dtype).removeprefix("torch."))
    return out


def _safetensors_name(stage: int, stages: int) -> str:
    return "model.safetensors" if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def megatron_to_hf(megatron_dir: str, out_dir: str, hf_config: str | None = None) -> Path:
    """Export a converted or trainer checkpoint as an HF checkpoint; returns the output directory."""
    from safetensors.torch import save_file

    src = Path(megatron_dir)
    if (src / fmt.META).is_file():
        shards, tp, pp = fmt.read_all_converted(src)
        side = hf_config or str(src)
    else:
        if not hf_config:
            raise ValueError(f"{src} is a trainer checkpoint (no {fmt.META}): pass --hf-config DIR "
                             "(the run's model.hf_path) for config.json and the tokenizer")
        shards, tp, pp = fmt.read_trainer_checkpoint(src)
        side = hf_config
    arch = read_qwen2_arch(side)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for pp_rank in range(pp):
        stage = megatron_stage_to_hf([shards.pop((t, pp_rank)) for t in range(tp)], arch, pp_rank, pp)
        fname = _safetensors_name(pp_rank, pp)
        save_file({k: v.contiguous() for k, v in stage.items()}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in stage})
        total += sum(v.numel() * v.element_size() for v in stage.values())
    if pp > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    fmt.copy_hf_side_files(side, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_m = sub.add_parser("hf-to-megatron", help="HF checkpoint -> Megatron (TP, PP) shards")
    to_m.add_argument("--hf", required=True, help="HF Qwen2/Qwen2.5 checkpoint directory")
    to_m.add_argument("--out", required=True, help="output directory")
    to_m.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    to_m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_m.add_argument("--dtype", default="auto", choices=sorted(_DTYPES), help="cast weights (auto: keep)")
    to_h = sub.add_parser("megatron-to-hf", help="Megatron shards or trainer checkpoint -> HF checkpoint")
    to_h.add_argument("--megatron", required=True, help="converted or trainer checkpoint directory")
    to_h.add_argument("--out", required=True, help="output directory")
    to_h.add_argument("--hf-config", default=None, help="HF dir with config.json + tokenizer (trainer checkpoints)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.command == "hf-to-megatron":
        out = hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.dtype)
    else:
        out = megatron_to_hf(args.megatron, args.out, args.hf_config)
    print(f"{args.command}: wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

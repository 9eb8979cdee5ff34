"""Run one part of the check in this process and write its row as JSON (the runner starts this).

    python -m tests.gpu.check.run_part NAME --mode gpu|cpu --workdir DIR --result FILE
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    # A part forked from the preloaded forkserver (CPU mode, forked.py) starts with megatron-core imported.
    row: dict = {"part": args.name, "process": "forked" if "megatron.core" in sys.modules else "fresh"}
    try:
        from tests.gpu.check.common import Context, SkipPart
        from tests.gpu.check.parts import part_function

        fn = part_function(args.name)
        try:
            row.update(fn(Context(args.mode, Path(args.workdir))))
        except SkipPart as skip:
            row.update(status="skip", summary=f"skipped on {args.mode.upper()} ({skip})" if args.mode == "cpu"
                       else f"skipped ({skip})")
    except BaseException as exc:  # report every failure as a row; the traceback goes to the part's log
        traceback.print_exc()
        last = str(exc).strip().splitlines()[-1:] or [""]
        row.update(status="error", summary=f"{type(exc).__name__}: {last[0][:300]}")
    # The GPU machine has neither: a part that needs them would only fail there.
    absent_there = sorted({m.split(".")[0] for m in sys.modules} & {"ray", "vllm"})
    if absent_there and row.get("status") != "error":
        row.update(status="error", summary=f"imported {', '.join(absent_there)}, which the GPU machine does not have; "
                   + row.get("summary", ""))
    row["seconds"] = time.perf_counter() - start
    Path(args.result).write_text(json.dumps(row, indent=1, default=str))
    print(f"{args.name}: {row['status']}: {row.get('summary', '')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

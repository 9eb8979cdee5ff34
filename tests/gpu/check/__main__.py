"""The GPU check: every part in its own process and time budget, one table, one summary line.

    python -m tests.gpu.check            # GPU mode (one CUDA device), ~5 minutes on an H200
    python -m tests.gpu.check --cpu      # the same parts with tiny sizes on CPU (gloo, the CPU shim)
    python -m tests.gpu.check --parts decode,train_throughput --budget decode=60

``tests/gpu/run_on_device.sh`` is the device command (it installs the carried wheels first).
Writes gpu_check.json (every row and figure), engine_constants.json (engine_constants_graph.json
too on a GPU), train_calibration.json, gpu_check.log and part_logs.tar.gz into ``--out`` (default:
$OUT when set). Exit status 1 when any part failed, errored, timed out or could not run; skipped
parts do not fail the run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from tests.gpu.check.harness import FAILING, Runner, format_table, summary_line
from tests.gpu.check.parts import SPECS

DEADLINE_S = {"gpu": 480.0, "cpu": 420.0}
"""No part starts later than this (s). On the GPU: the parts took 417 s before the simulator in the
third H200 run; with pip's install and the machine's start the call stays within its 600 s."""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _device() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {exc}"
    return out or "nvidia-smi printed nothing"


def _selected(names: str) -> list:
    if not names:
        return list(SPECS)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {s.name for s in SPECS}
    if unknown:
        raise SystemExit(f"gpu_check: unknown parts {sorted(unknown)}; parts: {', '.join(s.name for s in SPECS)}")
    grown = True
    while grown:  # a selected part brings the parts it needs
        extra = {n for s in SPECS if s.name in wanted for n in s.needs} - wanted
        wanted |= extra
        grown = bool(extra)
    return [s for s in SPECS if s.name in wanted]


def _budgets(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"gpu_check: --budget {item!r} is not NAME=SECONDS") from None
        if not sep or name not in {s.name for s in SPECS}:
            raise SystemExit(f"gpu_check: --budget {item!r}: unknown part {name!r}")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (gloo, the CPU shim, fp32)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="where the JSON and logs go (default $OUT)")
    ap.add_argument("--workdir", default="", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--parts", default="", help="comma-separated subset (the parts they need come along)")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="override a budget")
    ap.add_argument("--deadline", type=float, default=0.0, help="no part starts after this many seconds")
    ap.add_argument("--jobs", type=int, default=0, help="parts at a time (default: 1 on GPU, 2 on CPU)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    specs = _selected(args.parts)
    budgets = _budgets(args.budget)
    own_workdir = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else None
    print(f"gpu_check: mode {mode}; python {platform.python_version()}; torch {_version('torch')}; "
          f"megatron-core {_version('megatron-core')}; transformers {_version('transformers')}; "
          f"transformer-engine {_version('transformer-engine')}; device: {_device()}; workdir {workdir}", flush=True)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(workdir),
           "MEGATRON_RL_NUM_THREADS": "8" if mode == "gpu" else "1"}
    if mode == "cpu":
        env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    start = time.monotonic()
    runner = Runner(specs, mode, workdir, args.deadline or DEADLINE_S[mode],
                    jobs=args.jobs or (1 if mode == "gpu" else 2), budgets=budgets, env=env, fork_parts=mode == "cpu")
    rows = runner.run()
    seconds = time.monotonic() - start
    lines = []
    for row in rows:
        if row.status in FAILING and row.log_tail:
            lines += [f"--- {row.part} ({row.status}), end of its log:", row.log_tail.rstrip(), ""]
    lines += format_table(rows, specs)
    for name in ("engine_constants.json", "engine_constants_graph.json", "train_calibration.json"):
        if (workdir / name).is_file():
            lines.append(f"  {name}: {(workdir / name).read_text().strip()}")
    lines.append("  the simulator with them: rollpacker-simulate --recipe R.yaml --engine-constants "
                 "engine_constants.json --train-s-per-token S --train-fixed-s F (or --gpu h200 --mfu M "
                 "--hbm-efficiency H); see gpu_check.json")
    lines.append(summary_line(rows, mode, seconds))
    text = "\n".join(lines)
    print(text, flush=True)
    report = {"mode": mode, "seconds": seconds, "python": platform.python_version(),
              "versions": {n: _version(n) for n in ("torch", "megatron-core", "transformers", "transformer-engine")},
              "device": _device(), "rows": [asdict(r) for r in rows]}
    (workdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("gpu_check.json", "engine_constants.json", "engine_constants_graph.json",
                     "train_calibration.json"):
            if (workdir / name).is_file():
                shutil.copy(workdir / name, out / name)
        with tarfile.open(out / "part_logs.tar.gz", "w:gz") as tar:
            tar.add(workdir / "logs", arcname="logs")
            tar.add(workdir / "results", arcname="results")
    if own_workdir:  # the models are large on a GPU; the rows and logs went to --out
        for name in ("model", "tiny_model"):
            shutil.rmtree(workdir / name, ignore_errors=True)
    return 1 if any(r.status in FAILING for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

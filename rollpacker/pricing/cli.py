"""``rollpacker-price RUN_DIR [RUN_DIR ...]``: price runs' engine-step traces and training shapes
with the CPU model fitted on this machine or an H800/H100/H200 model (docs/pricing.md)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from rollpacker.pricing.cpu_model import CpuModel, fit_cpu_model
from rollpacker.pricing.gpu_model import PRICED_GPUS, gpu_model
from rollpacker.pricing.price import RunPrice, price_trace
from rollpacker.pricing.trace import TraceError, read_trace


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _f(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def format_run(price: RunPrice, measured: bool) -> list[str]:
    """The per-step table and the run summary, as printed."""
    lines = [f"== {price.run_dir}", f"   model: {price.model}"]
    head = f"{'step':>4} {'round':<9} {'eng':>3} {'iters':>6}  {'rollout':>8} {'train':>8} {'step':>8}"
    if measured:
        head += f"  {'meas.roll':>9} {'meas.train':>10} {'meas.step':>9}"
    head += f"  {'lim.iters':>9} {'lpt':>6} {'frac.it':>7} {'lim.s':>8} {'frac.s':>6}"
    lines.append(head)
    for s in price.steps:
        row = f"{s.step:>4} {s.round:<9} {s.engines:>3} {s.iterations:>6}  {s.rollout_s:>8.3f} {s.train_s:>8.3f} {s.step_s:>8.3f}"
        if measured:
            row += f"  {_s(s.measured_rollout_s):>9} {_s(s.measured_train_s):>10} {_s(s.measured_step_s):>9}"
        p = s.packing
        row += (f"  {p.iterations:>9} {p.lpt_iterations:>6} {_f(p.iteration_fraction):>7} {p.time_s:>8.3f} {_f(p.time_fraction):>6}"
                if p is not None else "  (no batch line)")
        lines.append(row)
    sm = price.summary()
    total = f"   total: rollout {sm['rollout_s']:.2f} s, train {sm['train_s']:.2f} s, step {sm['step_s']:.2f} s"
    if measured:
        warm = sm["warm_rollout_s"] / sm["warm_measured_rollout_s"] if sm["warm_measured_rollout_s"] else float("nan")
        total += (f" (measured: rollout {sm['measured_rollout_s']:.2f} s, train {sm['measured_train_s']:.2f} s, "
                  f"step {sm['measured_step_s']:.2f} s); rollout priced/measured after the first step {_f(warm)}")
    lines += [total, f"   packing limit: {_f(sm['packing_iteration_fraction'])} of the iterations, "
                     f"{_f(sm['packing_time_fraction'])} of the priced rollout time "
                     f"(median step {_f(sm['packing_time_fraction_median_step'])})"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rollpacker-price", description=__doc__)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories with engine_trace.jsonl")
    ap.add_argument("--gpu", default="cpu", choices=("cpu", *PRICED_GPUS), help="cost model (default: cpu)")
    ap.add_argument("--cpu-constants", help="CPU model constants (JSON written by --fit-cpu)")
    ap.add_argument("--fit-cpu", metavar="OUT.json", help="fit the CPU model on the given runs and write it here")
    ap.add_argument("--as-model", choices=("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"),
                    help="GPU models: price the token schedule as this shape (default: the run's model)")
    ap.add_argument("--engine-constants", help="GPU models: the GPU check's measured engine constants (JSON)")
    ap.add_argument("--json", metavar="OUT", help="write the priced runs as JSON")
    args = ap.parse_args(argv)
    try:
        runs = [read_trace(d) for d in args.run_dirs]
        cpu = None
        if args.fit_cpu:
            cpu = fit_cpu_model(runs)
            cpu.to_json(args.fit_cpu)
            print(f"fitted: {cpu.describe()} -> {args.fit_cpu}")
        elif args.cpu_constants:
            cpu = CpuModel.from_json(args.cpu_constants)
        if args.gpu == "cpu" and cpu is None:
            ap.error("--gpu cpu needs --cpu-constants FILE or --fit-cpu OUT.json")
        prices = [price_trace(run, cpu if args.gpu == "cpu" else gpu_model(run, args.gpu, args.as_model,
                                                                           args.engine_constants)) for run in runs]
    except TraceError as exc:
        print(f"rollpacker-price: error: {exc}", file=sys.stderr)
        return 2
    for p in prices:
        print("\n".join(format_run(p, measured=args.gpu == "cpu")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": args.gpu, "runs": [p.to_dict() for p in prices]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

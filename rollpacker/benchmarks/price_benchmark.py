"""A benchmark's runs priced in the GPU regime: the rows the speed tables add beside their wall-clock ones.

    rollpacker-price-benchmark runs/bench_peers [--gpu h800] [--as-model qwen2.5-7b] [--record docs/results/peers_priced.json]

Reads the output directory of ``rollpacker-benchmark`` (``benchmark.json``: two-run comparisons),
``--compare peers`` (``peers.json``) or ``--compare speculative`` (``speculative.json``), prices every run's engine trace with
``rollpacker.pricing`` (each engine iteration at the GPU model's cost, the trained batch at its
training cost) and prints per arm, median [range] over the runs:

* GPU-priced step and rollout time per step, and the speedup over the first arm (the baseline),
  each run's ratio against the baseline run of the same seed and pass;
* the packing-limit fraction: the fewest decode iterations (and least GPU-priced time) in which
  the run's engines could have produced the tokens it trained, over what the run took
  (``rollpacker.pricing.packing``), per step (each step's batch on its own: a batch smaller than
  the slots has its longest response for a limit) and over the whole run (slots full across steps:
  the limit of packing decode steps full); 1.0 is a schedule at the limit (per step not shown for a
  scheduler whose responses span steps, :data:`SPANS_STEPS`; with speculation the limit takes the
  step's mean tokens per iteration, so a step can pass 1.0 slightly);
* the engine trace's own cost as a share of the loop time (``engine_trace/cost_s``).

Priced figures depend on the token schedule, not on the time each iteration took, so one pass per
seed is enough (the wall-clock rows need repeat passes; what the machine's load still changes in the
schedule: docs/pricing.md). ``--record PATH`` writes a results file that
``joins`` the benchmark's own (``python -m megatron_rl.tools.results_tables`` renders its rows in
that table).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from megatron_rl.runtime.metrics_logger import read_metrics
from rollpacker.benchmarks.common import spread

ROWS = [
    ("{gpu}-priced step time, as {model} (s)", "priced_step_s", "{:.2f}"),
    ("{gpu}-priced rollout per step, as {model} (s)", "priced_rollout_s", "{:.2f}"),
    ("{gpu}-priced speedup vs baseline", "priced_speedup", "{:.2f}x"),
    ("packing-limit fraction per step, decode iterations", "packing_iterations", "{:.2f}"),
    ("packing-limit fraction per step, {gpu}-priced time", "packing_time", "{:.2f}"),
    ("packing-limit fraction, whole run, decode iterations", "run_packing_iterations", "{:.2f}"),
    ("packing-limit fraction, whole run, {gpu}-priced time", "run_packing_time", "{:.2f}"),
    ("engine trace cost (% of loop time)", "trace_cost_pct", "{:.2f}"),
]


COLUMN_SUMMARIES = ("peers.json", "speculative.json")
"""Summary files of the comparisons that run columns with ``benchmarks.common.run_columns``."""


def benchmark_runs(out: Path) -> tuple[list[str], dict[str, dict[str, Path]], dict]:
    """(arms in table order, {run label: {arm: run dir}}, the benchmark's summary file) of a benchmark's output."""
    column_file = next((out / n for n in COLUMN_SUMMARIES if (out / n).is_file()), None)
    if column_file is not None:
        summary = json.loads(column_file.read_text())
        labels = list(summary["runs"])
        arms = list(summary["runs"][labels[0]])
        runs = {}
        for label in labels:  # "seed S, pass P" -> OUT/passP/seedS/<arm> (benchmarks.common.run_columns)
            seed, run = (int(part.split()[-1]) for part in label.split(", "))
            runs[label] = {arm: out / f"pass{run}" / f"seed{seed}" / arm.replace("+", "_") for arm in arms}
        return arms, runs, summary
    if (out / "benchmark.json").is_file():
        summary = json.loads((out / "benchmark.json").read_text())
        arms = list(summary["runs"])
        runs: dict[str, dict[str, Path]] = {}
        for arm in arms:
            for r in summary["runs"][arm]:
                runs.setdefault(f"seed {r['seed']}, pass {r['run']}", {})[arm] = Path(r["run_dir"])
        return arms, runs, summary
    found = sorted(p.parent for p in out.glob("pass*/seed*/*/engine_trace.jsonl") if _finished(p.parent))
    if not found:
        raise ValueError(f"{out}: none of {', '.join(COLUMN_SUMMARIES)}, benchmark.json, nor run directories with an "
                         "engine trace (out/passP/seedS/ARM; the output directory of rollpacker-benchmark)")
    # A benchmark stopped before its summary: its finished runs, the baseline arm first.
    names = sorted({d.name for d in found}, key=lambda n: (n != "baseline", n))
    runs = {}
    for d in found:
        label = f"seed {d.parent.name.removeprefix('seed')}, pass {d.parent.parent.name.removeprefix('pass')}"
        runs.setdefault(label, {})[d.name] = d
    return names, {label: runs[label] for label in sorted(runs)}, {}


def _finished(run_dir: Path) -> bool:
    """The run logged every step its config asked for (a run cut short is not priced)."""
    try:
        steps = json.loads((run_dir / "config.json").read_text())["trainer"]["steps"]
        return len(read_metrics(run_dir)) >= int(steps)
    except (OSError, KeyError, ValueError):
        return False


def trace_cost_pct(run_dir: Path) -> float | None:
    """The engine trace's cost over the loop time, in percent (None when the run recorded no trace)."""
    rows = read_metrics(run_dir)
    cost = sum(float(r.get("engine_trace/cost_s", 0.0)) for r in rows)
    loop = sum(float(r["time/step"]) for r in rows)
    return 100.0 * cost / loop if loop and any("engine_trace/cost_s" in r for r in rows) else None


SPANS_STEPS = frozenset({"partial_rollout"})
"""Schedulers whose responses continue across steps: a step trains tokens earlier steps generated,
so its own packing limit would count work it did not do (their whole-run fraction stands)."""


def run_figures(run_dir: Path, gpu: str, as_model: str | None) -> dict:
    from rollpacker.pricing.price import price_run

    price = price_run(run_dir, gpu, as_model)
    summary = price.summary()
    steps = max(1, len(price.steps))
    scheduler = json.loads((run_dir / "config.json").read_text()).get("scheduler", {}).get("name")
    per_step = scheduler not in SPANS_STEPS
    return {"priced_step_s": price.total("step_s") / steps, "priced_rollout_s": price.total("rollout_s") / steps,
            "packing_iterations": price.packing_iteration_fraction if per_step else None,
            "packing_time": price.packing_time_fraction if per_step else None,
            "run_packing_iterations": summary["run_packing_iteration_fraction"],
            "run_packing_time": summary["run_packing_time_fraction"],
            "trace_cost_pct": trace_cost_pct(run_dir), "priced_by": price.model}


DEFAULT_PAIR_LABELS = {"baseline": "baseline", "tail_batching": "RollPacker"}
"""The default two-run comparison's column labels by run name, for an output without its summary."""


def price_benchmark(out: Path, gpu: str, as_model: str | None) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """Every run of the benchmark at ``out`` priced: (arms, {run label: {arm: figures}}); a two-run
    comparison's arms carry its table's column labels."""
    arms, run_dirs, summary = benchmark_runs(out)
    if (out / "benchmark.json").is_file() or not summary:
        labels = summary.get("labels") or DEFAULT_PAIR_LABELS
        arms = [labels.get(a, a) for a in arms]
        run_dirs = {label: {labels.get(a, a): d for a, d in cols.items()} for label, cols in run_dirs.items()}
    missing = [str(d) for cols in run_dirs.values() for d in cols.values() if not (d / "engine_trace.jsonl").is_file()]
    if missing:
        raise ValueError(f"no engine_trace.jsonl in {missing[:3]}{' ...' if len(missing) > 3 else ''}: the runs predate "
                         "rollout.engine_trace (rerun the benchmark; benchmarks record it by default)")
    runs = {}
    for label, cols in run_dirs.items():
        runs[label] = {arm: run_figures(cols[arm], gpu, as_model) for arm in arms if arm in cols}
        base = runs[label][arms[0]]["priced_step_s"]
        for fig in runs[label].values():
            fig["priced_speedup"] = base / fig["priced_step_s"] if fig["priced_step_s"] else None
        print(f"[price] {label}: " + ", ".join(f"{arm} {fig['priced_step_s']:.2f} s/step" for arm, fig in runs[label].items()),
              flush=True)
    return arms, runs


def rows_for(gpu: str, as_model: str | None) -> list[tuple[str, str, str]]:
    model = as_model or "the run's model"
    return [(title.format(gpu=gpu.upper(), model=model), key, fmt) for title, key, fmt in ROWS]


def print_table(out: Path, arms: list[str], runs: dict[str, dict[str, dict]], gpu: str, as_model: str | None) -> None:
    print(f"\n{len(runs)} run(s) of {out}, priced on {gpu.upper()} as {as_model or 'the run model'}")
    print("| metric | " + " | ".join(arms) + " |")
    for title, key, fmt in rows_for(gpu, as_model):
        print(f"| {title} | " + " | ".join(spread([cols.get(a, {}).get(key) for cols in runs.values()], fmt)
                                          for a in arms) + " |")


def report(out: Path, gpu: str = "h800", as_model: str | None = "qwen2.5-7b") -> None:
    """The priced table of a benchmark that just ran (its own table stays; a failure here only warns)."""
    try:
        arms, runs = price_benchmark(out, gpu, as_model)
    except Exception as exc:  # the wall-clock figures stand without the priced ones
        print(f"priced figures not computed: {exc}", file=sys.stderr)
        return
    print_table(out, arms, runs, gpu, as_model)
    print(f"(rollpacker-price-benchmark {out} --record docs/results/NAME_priced.json records them)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the benchmark's --out directory")
    parser.add_argument("--gpu", default="h800", choices=["h800", "h100", "h200"])
    parser.add_argument("--as-model", default="qwen2.5-7b", help="price the token schedule as this model "
                        "(qwen2.5-7b|14b|32b); 'run' keeps the run's own model")
    parser.add_argument("--joins", help="the results file the recorded rows join (default: the --record name less "
                        "'_priced')")
    parser.add_argument("--record", metavar="PATH", help="write the results file (docs/results/NAME_priced.json)")
    parser.add_argument("--benchmark-command", help="the command that made the runs, where the benchmark's summary "
                        "file does not hold it")
    parser.add_argument("--model", help="the runs' model directory, where the summary file does not hold it")
    args = parser.parse_args(argv)
    as_model = None if args.as_model == "run" else args.as_model
    try:
        arms, runs = price_benchmark(args.out, args.gpu, as_model)
    except (ValueError, OSError) as exc:
        print(f"rollpacker-price-benchmark: {exc}", file=sys.stderr)
        return 2
    rows = rows_for(args.gpu, as_model)
    print_table(args.out, arms, runs, args.gpu, as_model)
    if args.record:
        from megatron_rl.tools.results_record import rows_spec, write_record

        _, _, summary = benchmark_runs(args.out)
        model = (summary.get("args") or {}).get("model") or args.model
        joins = args.joins or Path(args.record).stem.removesuffix("_priced")
        write_record(args.record, name=Path(args.record).stem,
                     command=shlex.join(["rollpacker-price-benchmark", *(sys.argv[1:] if argv is None else argv)]),
                     columns=arms, rows=rows_spec(rows), runs=runs, model_dir=model,
                     extra={"joins": joins, "runs_note": f"{len(runs)} run(s), one per seed, of the benchmark command "
                            "named in it, each run's engine iterations priced (docs/pricing.md)",
                            "benchmark_command": summary.get("command") or args.benchmark_command})
        print(f"results file: {args.record} (joins {joins}; python -m megatron_rl.tools.results_tables)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

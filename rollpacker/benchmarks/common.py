"""What the loop benchmarks share: the run config of one benchmark run, the tail-batching period
arithmetic, the options of the column-style runs (``--compare speculative``, ``--compare arms``,
``rollpacker-profile-loop``) and the ``median [range]`` cells of their tables.

A leaf: it imports no other benchmark module, so ``benchmark`` (the ``--compare`` dispatch) and
every benchmark it dispatches to import it without an import circle.
"""
from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from megatron_rl.benchmarks.run_config import benchmark_config  # noqa: F401  (the comparisons import it from here)
from megatron_rl.config.schema import RunConfig
from megatron_rl.tools import REPO_ROOT as REPO
from rollpacker.config import TailBatchingConfig


def period_steps(eta_prompts: float, prompts_per_step: int) -> int:
    """Steps of one tail-batching period: short rounds until the queue holds P0, then a long one."""
    queued_per_short = math.ceil(eta_prompts * prompts_per_step) - prompts_per_step
    if queued_per_short <= 0:
        return 1  # eta_P = 1: no queue, every round is short
    return math.ceil(prompts_per_step / queued_per_short) + 1


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options that shape every column's run (``--compare speculative``, ``--compare arms``,
    rollpacker-profile-loop)."""
    parser.add_argument("--model", default=str(REPO / "artifacts/tiny-qwen2.5-rechecks"))
    parser.add_argument("--periods", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=2.0, help="passes over the prompt set in the run")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234, help="first seed; seeds are seed, seed+1, ...")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides for every run")


def check_run_options(args) -> str:
    """An error message for options no run can use, or ''."""
    if not (Path(args.model) / "config.json").is_file():
        return (f"no model at {args.model}: build it with megatron-rl-make-tiny-model --out {args.model} "
                "--recheck-rate 0.08")
    if args.epochs <= 1:
        return "--epochs must be > 1: rollout history needs an earlier epoch"
    return ""


def run_shape(args) -> tuple[int, int]:
    """(steps per run, prompts in the set): whole tail-batching periods, ``--epochs`` passes."""
    probe = benchmark_config(args, "tail_batching", 1, Path(args.out))
    steps = args.periods * period_steps(probe.section(TailBatchingConfig).eta_prompts, args.prompts_per_step)
    return steps, max(args.prompts_per_step, round(steps * args.prompts_per_step / args.epochs))


def spread(values: list, fmt: str = "{:.2f}") -> str:
    """``median [min-max]`` of the numbers among ``values`` (just the median when they agree), '-'
    when there are none: one cell of a benchmark table over several runs."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return "-"
    med, lo, hi = statistics.median(values), min(values), max(values)
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def ratio_line(title: str, values: list[float]) -> str:
    """``title: median (range lo-hi, n runs: each)`` of a ratio over runs, ``title: n/a`` without runs."""
    if not values:
        return f"{title}: n/a"
    return (f"{title}: {statistics.median(values):.2f} (range {min(values):.2f}-{max(values):.2f}, {len(values)} runs: "
            + ", ".join(f"{v:.2f}" for v in values) + ")")


def plot_curves(runs: dict[str, dict[str, dict]], path: Path, colors: dict[str, str], width: float = 12) -> None:
    """Train reward per step and validation pass@1 of every column (one colour each, every run drawn
    faintly) from the figures' ``curves``, as two panels in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(width, 4))
    first = next(iter(runs))
    for label, cols in runs.items():
        for name, fig_data in cols.items():
            c = fig_data["curves"]
            legend = name if label == first else None
            ax_r.plot(c["step"], c["reward"], color=colors[name], alpha=0.6, label=legend)
            if c["val"]:
                ax_v.plot(c["val_step"], c["val"], "o-", color=colors[name], alpha=0.6, label=legend)
    ax_r.set(title="train reward (mean per step)", xlabel="step")
    ax_v.set(title="validation pass@1", xlabel="step")
    for ax in (ax_r, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def column_run_config(args, columns: list[tuple[str, str, list[str]]], column: str, seed: int, run_dir: Path,
                      evaluations: int) -> RunConfig:
    """The run config of one column (``(name, scheduler, overrides)`` of ``columns``) at one seed:
    the same prompts, seeds and evaluation in every column, ``evaluations`` validations per run."""
    scheduler, extra = next((sched, extra) for name, sched, extra in columns if name == column)
    steps, num_prompts = run_shape(args)
    args.seed = seed
    return benchmark_config(args, scheduler, steps, run_dir, [
        f"data.builtin_num_prompts={num_prompts}", f"data.eval_every={max(1, steps // evaluations)}", *extra])


def interleaved_order(passes: int, seeds: list[int], names: list[str]) -> list[tuple[int, int, list[str]]]:
    """(pass, seed, columns in run order): as listed, then reversed, alternating over every
    (pass, seed), so that a drift of the machine's speed hits every column alike."""
    order, flip = [], False
    for run in range(passes):
        for seed in seeds:
            order.append((run, seed, names[::-1] if flip else names))
            flip = not flip
    return order


def run_columns(args, names: list[str], config_for, figures_of) -> dict[str, dict[str, dict]]:
    """Runs every column at every (pass, seed) of :func:`interleaved_order` and returns
    ``{"seed S, pass P": {column: figures}}`` with the columns in ``names``' order.
    ``config_for(args, column, seed, run_dir)`` builds a run's config; ``figures_of(rows)``
    turns its metrics rows into the figures (plus ``wall_time_with_startup``)."""
    import time

    from megatron_rl.runtime.metrics_logger import read_metrics
    from megatron_rl.train import build_and_run

    steps, num_prompts = run_shape(args)
    seeds = list(range(args.seed, args.seed + args.seeds))
    runs: dict[str, dict[str, dict]] = {}
    for run, seed, order in interleaved_order(args.runs, seeds, names):
        label = f"seed {seed}, pass {run}"
        runs[label] = {}
        for name in order:
            run_dir = Path(args.out) / f"pass{run}" / f"seed{seed}" / name.replace("+", "_")
            cfg = config_for(args, name, seed, run_dir)
            print(f"[benchmark] {label} {name}: {steps} steps x {args.prompts_per_step} prompts x {args.responses} "
                  f"responses over {num_prompts} prompts -> {run_dir}", flush=True)
            start = time.monotonic()
            build_and_run(cfg)
            runs[label][name] = figures_of(read_metrics(run_dir))
            runs[label][name]["wall_time_with_startup"] = time.monotonic() - start
        runs[label] = {n: runs[label][n] for n in names}
    return runs

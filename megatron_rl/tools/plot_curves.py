"""Plot training curves of a run from its metrics.jsonl.

    megatron-rl-plot-curves RUN_DIR [--out PNG]

Four panels against step: reward; accuracy (+ validation pass@1 when logged); response length
(mean / p90 / max); step-time split (stacked phases under the step wall time). Panels whose
metrics are absent say so instead of failing, so early or partial runs still plot.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.runtime.metrics_logger import (
    ACCURACY_KEY,
    RESPONSE_LENGTH_PREFIX,
    REWARD_KEY,
    STEP_TIME_KEY,
    TIMING_PREFIX,
    VAL_PASS1_KEY,
    read_metrics,
)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a numeric ``key``."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _plot_lines(ax, records, keys_and_labels, title: str, ylabel: str) -> None:
    drawn = False
    for key, label, style in keys_and_labels:
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, style, label=label)
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_moving_average(ax, records, key: str, window: int) -> None:
    """Trailing mean over ``window`` steps: per-step train reward swings with the difficulty of
    the step's prompts, the trend is what RL changes."""
    steps, values = _series(records, key)
    if len(values) < window:
        return
    means = [sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]
    ax.plot(steps[window - 1 :], means, "-", linewidth=2.2, label=f"train reward ({window}-step mean)")
    ax.legend(loc="best", fontsize=8)


def _plot_timing(ax, records) -> None:
    phases = sorted({k for r in records for k in r if k.startswith(TIMING_PREFIX) and k != STEP_TIME_KEY})
    steps = [r["step"] for r in records]
    stacks: list[list[float]] = []
    if phases:
        # Missing phases in a step (e.g. no weight sync on the last one) count as zero.
        stacks = [[float(r.get(p) or 0.0) for r in records] for p in phases]
        ax.stackplot(steps, stacks, labels=[p[len(TIMING_PREFIX):] for p in phases], alpha=0.8)
    step_steps, step_times = _series(records, STEP_TIME_KEY)
    if step_steps:
        ax.plot(step_steps, step_times, "k-", linewidth=1.2, label="step (wall)")
    ax.set_title("step-time split")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    if phases or step_steps:
        # Headroom above the tallest bar so the legend does not cover the data.
        tallest = max([sum(col) for col in zip(*stacks)] if phases else [0.0])
        ax.set_ylim(0, 1.45 * max([tallest, *step_times]) or 1.0)
        ax.legend(loc="upper left", fontsize=7, ncol=3)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_curves(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render the curves of ``run_dir`` (or a metrics.jsonl path) into a PNG; returns its path
    (default: ``<run_dir>/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir} has no metrics records to plot")
    base = run_dir if run_dir.is_dir() else run_dir.parent
    out_path = Path(out) if out else base / "curves.png"

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _plot_lines(axes[0][0], records, [(REWARD_KEY, "train reward", "-"), ("val/reward_mean", "val reward", "o--")],
                "reward", "mean reward")
    _plot_moving_average(axes[0][0], records, REWARD_KEY, window=5)
    _plot_lines(
        axes[0][1],
        records,
        [(ACCURACY_KEY, "train accuracy", "-"), (VAL_PASS1_KEY, "val pass@1", "o--")],
        "accuracy",
        "fraction correct",
    )
    _plot_lines(
        axes[1][0],
        records,
        [(RESPONSE_LENGTH_PREFIX + s, s, "-") for s in ("mean", "p90", "max")],
        "response length",
        "tokens",
    )
    _plot_timing(axes[1][1], records)
    fig.suptitle(str(base.resolve().name))
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (or the file itself)")
    parser.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    print(plot_curves(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

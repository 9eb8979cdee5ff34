"""Rollout timeline: one bar per engine request over time, baseline and RollPacker side by side.

    rollpacker-plot-timeline BASELINE_RUN_DIR ROLLPACKER_RUN_DIR [--out timeline.png] [--steps N]

Reads each run's rollout_timeline.jsonl (written by the trainer). Bars are coloured by round
type (baseline, short, long); aborted requests are drawn in red. The gaps between a step's
rollout and the next are training + weight sync; the thin tails at the end of a baseline step
are the bubbles tail batching removes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLOURS = {"baseline": "#7f7f7f", "short": "#1f77b4", "long": "#ff7f0e", "eval": "#2ca02c"}


def read_timeline(run_dir: Path, max_steps: int | None = None) -> list[dict]:
    path = Path(run_dir) / "rollout_timeline.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (written by the trainer during a run)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:max_steps] if max_steps else rows


def _draw(ax, rows: list[dict], title: str) -> float:
    """Draw one run; returns its end time."""
    y = 0
    t_start = rows[0]["window"][0] if rows else 0.0
    end = 0.0
    for rec in rows:
        colour = COLOURS.get(rec["round_type"], "#9467bd")
        for start, finish, reason in sorted(rec["requests"], key=lambda r: r[0]):
            aborted = reason == "abort"
            ax.barh(y, finish - start, left=start - t_start, height=0.9,
                    color="#d62728" if aborted else colour, alpha=0.6 if aborted else 0.9, linewidth=0)
            y += 1
            end = max(end, finish - t_start)
        w0, w1 = rec["window"]
        ax.axvspan(w0 - t_start, w1 - t_start, color=colour, alpha=0.06)
        ax.text(w0 - t_start, y + 1, f"{rec['step']}{rec['round_type'][0]}", fontsize=7, va="bottom")
    ax.set_title(title)
    ax.set_ylabel("request (one bar each)")
    ax.set_ylim(0, max(y, 1) + 6)
    return end


def plot_timeline(baseline_dir: Path, rollpacker_dir: Path, out: Path, max_steps: int | None = None,
                  titles: tuple[str, str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    base, tb = read_timeline(baseline_dir, max_steps), read_timeline(rollpacker_dir, max_steps)
    fig, axes = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    top, bottom = titles or ("baseline: every response runs to the end",
                             "RollPacker tail batching: short rounds abort the tail, long rounds batch it")
    end_b = _draw(axes[0], base, f"{top} ({len(base)} steps)")
    end_t = _draw(axes[1], tb, f"{bottom} ({len(tb)} steps)")
    for ax in axes:
        ax.set_xlim(0, max(end_b, end_t) * 1.02)
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_xlabel("seconds since the first step's rollout started")
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items() if k != "eval"] + [Patch(color="#d62728", label="aborted")]
    axes[0].legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline_dir", type=Path)
    parser.add_argument("rollpacker_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("timeline.png"))
    parser.add_argument("--steps", type=int, default=None, help="only the first N steps of each run")
    args = parser.parse_args(argv)
    path = plot_timeline(args.baseline_dir, args.rollpacker_dir, args.out, args.steps)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

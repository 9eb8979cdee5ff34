"""Precision, recall and grading time of the math reward on the graded answer set.

    megatron-rl-grader-report [--data tests/data/math_grader_set.jsonl] [--timeout-s 2.0]
                                  [--adversarial] [--json OUT.json]

Every row (response, gold, expected, form) is scored through the real reward path: a
``MathReward``, i.e. the ``IsolatedCall`` grading child that reward workers use, with the
configured per-response timeout. Prints precision and recall over the set, false positives and
negatives by answer form (each listed), status counts, and per-response grading time measured
from the caller's side (median, p99, max). ``--adversarial`` also times inputs built to be slow
(100 KB of unclosed boxes, nested braces, huge powers and factorials): each must come back
within the timeout plus a small margin.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rl.config.schema import RewardConfig
from megatron_rl.reward.graders.math_reward import MathReward
from megatron_rl.tools import REPO_ROOT

DEFAULT_DATA = REPO_ROOT / "tests" / "data" / "math_grader_set.jsonl"
FORMS = ("complex", "polynomial", "interval", "tuple", "base", "equation", "units/text",
         "multiple choice", "percent", "thousands", "fraction/decimal/mixed", "matrix", "integer",
         "gsm8k")
"""The answer forms a row's ``form`` may name."""
_KEYS = {"form", "response", "gold", "expected", "note"}


def load_rows(path: Path) -> list[dict]:
    """The graded set; raises ValueError naming the file and row of a malformed one."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(row, dict) or set(row) != _KEYS:
                raise ValueError(f"{path}:{number}: expected the keys {sorted(_KEYS)}, got "
                                 f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
            if row["form"] not in FORMS:
                raise ValueError(f"{path}:{number}: form {row['form']!r} is not one of {FORMS}")
            if row["expected"] not in (0, 1):
                raise ValueError(f"{path}:{number}: expected must be 0 or 1, got {row['expected']!r}")
            if not isinstance(row["response"], str) or not isinstance(row["gold"], str):
                raise ValueError(f"{path}:{number}: response and gold must be strings")
            rows.append(row)
    return rows


@dataclass
class Report:
    """Confusion counts, misgraded rows and timing of one pass over the set."""

    tp: int = 0
    """Rows expected 1 and graded correct."""
    fp: int = 0
    """Rows expected 0 but graded correct (must stay 0)."""
    fn: int = 0
    """Rows expected 1 but graded wrong."""
    tn: int = 0
    """Rows expected 0 and graded wrong."""
    by_form: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per form: rows, tp, fp, fn, tn."""
    false_positives: list[dict] = field(default_factory=list)
    """The rows graded correct that are wrong (with the extracted answer)."""
    false_negatives: list[dict] = field(default_factory=list)
    """The rows graded wrong that are right (with the extracted answer and status)."""
    statuses: dict[str, int] = field(default_factory=dict)
    """How many rows ended with each RewardResult status."""
    times_s: list[float] = field(default_factory=list)
    """Per-response grading time from the caller's side, in row order."""

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def evaluate(rows: list[dict], reward: MathReward) -> Report:
    """Score every row with ``reward`` (the caller owns it) and tally the outcome."""
    report = Report()
    statuses: Counter[str] = Counter()
    for row in rows:
        start = time.monotonic()
        result = reward(row["response"], row["gold"])
        report.times_s.append(time.monotonic() - start)
        statuses[result.status] += 1
        counts = report.by_form.setdefault(row["form"], {"rows": 0, "tp": 0, "fp": 0, "fn": 0, "tn": 0})
        counts["rows"] += 1
        kind = ("tp" if result.correct else "fn") if row["expected"] else ("fp" if result.correct else "tn")
        counts[kind] += 1
        setattr(report, kind, getattr(report, kind) + 1)
        if kind in ("fp", "fn"):
            entry = dict(row, extracted=result.extracted, status=result.status, detail=result.detail)
            (report.false_positives if kind == "fp" else report.false_negatives).append(entry)
    report.statuses = dict(statuses)
    return report


def adversarial_cases() -> dict[str, str]:
    """Responses built to be slow to extract or to grade (gold '5' fits none of them)."""
    n = 100_000
    return {
        "100 KB of unclosed \\boxed{": "\\boxed{" * (n // 7),
        "100 KB of nested braces in a box": "\\boxed{" + "{" * (n // 2) + "5" + "}" * (n // 2 - 1) + "6}}",
        "100 KB #### line": "#### " + "9" * n,
        "10^{10^{10}}": "\\boxed{10^{10^{10}}}",
        "9^{9^{9^9}}": "\\boxed{9^{9^{9^{9}}}}",
        "(10^{10^{10}})!": "\\boxed{(10^{10^{10}})!}",
        "1000000!": "\\boxed{1000000!}",
        "900 nested parentheses": "\\boxed{" + "(" * 900 + "1" + ")" * 900 + "}",
    }


def time_adversarial(reward: MathReward) -> list[tuple[str, float, str]]:
    """(case, seconds from the caller's side, status) for each adversarial case, back to back."""
    out = []
    for name, response in adversarial_cases().items():
        start = time.monotonic()
        result = reward(response, "5")
        out.append((name, time.monotonic() - start, result.status))
    return out


def format_report(report: Report, timeout_s: float) -> str:
    """Human-readable summary of :func:`evaluate`'s report."""
    n = len(report.times_s)
    lines = [
        (f"rows {n}: {report.tp + report.fn} right answers, {report.fp + report.tn} wrong ones "
         f"(timeout {timeout_s} s per response)"),
        (f"precision {report.precision:.4f}  recall {report.recall:.4f}  "
         f"TP {report.tp}  FP {report.fp}  FN {report.fn}  TN {report.tn}"),
        f"statuses {report.statuses}",
        (f"grading time per response: median {statistics.median(report.times_s) * 1e3:.1f} ms, "
         f"p99 {percentile(report.times_s, 99) * 1e3:.1f} ms, max {max(report.times_s) * 1e3:.1f} ms"),
        "",
        f"{'form':24}{'rows':>6}{'TP':>5}{'FP':>5}{'FN':>5}{'TN':>5}",
    ]
    for form in FORMS:
        c = report.by_form.get(form)
        if c:
            lines.append(f"{form:24}{c['rows']:>6}{c['tp']:>5}{c['fp']:>5}{c['fn']:>5}{c['tn']:>5}")
    for title, entries in (("false positives", report.false_positives),
                           ("false negatives", report.false_negatives)):
        lines.append(f"\n{title} ({len(entries)}):")
        for e in entries:
            lines.append(f"  [{e['form']}] {e['note']}: answer {e['extracted']!r} vs gold {e['gold']!r} "
                         f"({e['status']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--timeout-s", type=float, default=RewardConfig().timeout_s)
    parser.add_argument("--adversarial", action="store_true", help="also time the slow-input cases")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = load_rows(args.data)
    reward = MathReward(timeout_s=args.timeout_s)
    try:
        reward.start()
        report = evaluate(rows, reward)
        print(format_report(report, args.timeout_s))
        adversarial = []
        if args.adversarial:
            adversarial = time_adversarial(reward)
            print("\nadversarial inputs (back to back, caller's side):")
            for name, seconds, status in adversarial:
                print(f"  {name:36} {seconds:6.3f} s  {status}")
    finally:
        reward.close()
    if args.json:
        figures = asdict(report) | {"precision": report.precision, "recall": report.recall,
                                    "median_s": statistics.median(report.times_s),
                                    "p99_s": percentile(report.times_s, 99),
                                    "adversarial": adversarial}
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Code-reward report: sandbox pass rates and per-response grading time on the code set in
tests/data, through the path the reward workers use (``RewardWorker.score``: token ids in,
decode, route by the prompt's format, run the sandbox, shape).

    megatron-rl-code-reward-report [--repeats 3] [--isolation auto] [--json report.json]

Scores every problem's correct solution and wrong solutions (tests/data/code_sandbox_set.jsonl)
and every attack (tests/data/code_sandbox_attacks.jsonl), ``--repeats`` times, one response at a
time, and prints: the isolation layers in force, the pass rate of correct, wrong and attack
responses, and the grading time per response (median, p99, min, max over correct + wrong
responses; attacks are reported apart, they include deliberate timeouts). Grading time is the
worker's own clock (``RewardOutcome.elapsed_s``: decode + sandbox run), which is what a reward
worker spends per response.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl.config.schema import RewardConfig
from megatron_rl.reward.pool.worker import RewardWorker
from megatron_rl.tools import REPO_ROOT

DATA = REPO_ROOT / "tests" / "data"


def _fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}```\n"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="times every response is scored")
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "audit"))
    parser.add_argument("--timeout", type=float, default=10.0, help="per-response limit (s) of the set")
    parser.add_argument("--attack-timeout", type=float, default=3.0, help="per-response limit (s) of the attacks")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from megatron_rl.model.tiny import build_tokenizer

    problems = [json.loads(line) for line in (DATA / "code_sandbox_set.jsonl").read_text().splitlines() if line]
    attacks = [json.loads(line) for line in (DATA / "code_sandbox_attacks.jsonl").read_text().splitlines() if line]
    by_id = {p["id"]: p for p in problems}
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tok_dir)
        cfg = RewardConfig(kind="code", code_timeout_max_s=args.timeout, sandbox_isolation=args.isolation)
        worker = RewardWorker(cfg, tok_dir, max_new_tokens=1 << 16)

        def score(problem: dict, code: str, timeout_s: float):
            ids = tokenizer.encode(_fenced(code), add_special_tokens=False)
            return worker.score(ids, problem["ground_truth"], problem["id"], problem["metadata"], timeout_s)

        layers = worker._code.isolation  # noqa: SLF001 - reported, not changed
        counts = {"correct": [0, 0], "wrong": [0, 0], "attack": [0, 0]}
        times: list[float] = []
        failures: list[str] = []
        start = time.monotonic()
        for _ in range(args.repeats):
            for problem in problems:
                for label, codes in (("correct", [problem["correct"]]), ("wrong", problem["wrong"])):
                    for code in codes:
                        outcome = score(problem, code, args.timeout)
                        counts[label][0] += outcome.correct
                        counts[label][1] += 1
                        times.append(outcome.elapsed_s)
                        if outcome.correct != (label == "correct"):
                            failures.append(f"{label} {problem['id']}: {outcome.status} {outcome.detail[:120]}")
            for attack in attacks:
                outcome = score(by_id[attack["problem"]], attack["code"], args.attack_timeout)
                counts["attack"][0] += outcome.correct
                counts["attack"][1] += 1
                if outcome.correct:
                    failures.append(f"attack {attack['id']} passed")
        wall = time.monotonic() - start
        worker.close()

    report = {
        "isolation": layers, "repeats": args.repeats, "problems": len(problems), "attacks": len(attacks),
        "pass_rate": {k: v[0] / v[1] for k, v in counts.items()}, "counts": counts,
        "grading_s": {"median": statistics.median(times), "p99": _percentile(times, 0.99), "min": min(times),
                      "max": max(times), "n": len(times)},
        "wall_s": wall, "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "failures": failures,
    }
    print(f"isolation: {', '.join(layers)}")
    print(f"set: {len(problems)} problems, {counts['wrong'][1] // args.repeats} wrong solutions, "
          f"{len(attacks)} attacks; {args.repeats} repeats")
    for label in ("correct", "wrong", "attack"):
        passed, total = counts[label]
        print(f"  {label:8s} responses passing: {passed}/{total} ({100.0 * passed / total:.1f} %)")
    g = report["grading_s"]
    print(f"grading time per response (correct + wrong, n={g['n']}): median {1e3 * g['median']:.0f} ms, "
          f"p99 {1e3 * g['p99']:.0f} ms, min {1e3 * g['min']:.0f} ms, max {1e3 * g['max']:.0f} ms")
    print(f"wall {wall:.1f} s; load average {report['loadavg'][0]:.2f} on {report['cpus']} CPUs")
    for line in failures:
        print("  unexpected:", line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

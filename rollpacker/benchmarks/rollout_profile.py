"""Build a rollout-TP profile for ``planner.profile`` from earlier runs.

    rollpacker-rollout-profile --run runs/tp1 --run runs/tp2 --out profile.json

Each run directory (metrics.jsonl + config.json, as train.py writes them) contributes every
step's rollout time under its round type and rollout TP; the profile holds the mean per (round
type, TP). Then ``planner.enabled=true planner.profile=profile.json`` starts each round type at
its fastest profiled TP (``planner.initial_tp`` entries still win).
"""
from __future__ import annotations

import argparse
import sys

from rollpacker.tp_profile import ProfileError, profile_from_runs, save_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="run directory (repeatable)")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    args = parser.parse_args(argv)
    try:
        profile, counts = profile_from_runs(args.run)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("| round type | TP | steps | mean rollout (s) |\n| --- | ---: | ---: | ---: |")
    for kind, times in profile.items():
        for tp, seconds in times.items():
            print(f"| {kind} | {tp} | {counts[kind][tp]} | {seconds:.2f} |")
    save_profile(profile, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

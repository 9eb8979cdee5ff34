"""Calibrate the what-if simulator against a measured rollpacker-benchmark run pair and check how
well it predicts the measured speedup (baseline loop time / tail-batching loop time).

    rollpacker-calibrate-simulator runs/benchmark/baseline runs/benchmark/tail_batching \
        [--check OTHER/baseline OTHER/tail_batching] [--write-constants cpu_engine.json]

Fits the engine (decode iteration = step + per-sequence * batch + per-context-token * context,
admission per prompt token) from the baseline run's request finish events and response lengths,
and training (s/token, fixed), weight sync and reward time from its metrics.jsonl (see
rollpacker/simulator/calibrate.py); then simulates baseline and tail batching with the baseline's
response lengths replayed in the run's prompt order and prints predicted vs measured speedup,
for the fitted pair and for each --check pair (constants not refitted). Last line:
``max error: X %``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollpacker.simulator.calibrate import fit_engine, fit_train, load_run, predict_pair, warmup_steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baseline", help="run dir of the baseline run (metrics.jsonl, rollout_timeline.jsonl)")
    ap.add_argument("tail_batching", help="run dir of the tail-batching run")
    ap.add_argument("--check", nargs=2, action="append", default=[], metavar=("BASELINE", "TAIL"),
                    help="another run pair to predict with the same constants (repeatable)")
    ap.add_argument("--prompt-tokens", type=int, default=54,
                    help="mean prompt tokens (54: builtin arithmetic task with the tiny model's chat template)")
    ap.add_argument("--seeds", type=int, default=8, help="simulations averaged per policy")
    ap.add_argument("--tolerance", type=float, default=0.15, help="acceptable relative speedup error")
    ap.add_argument("--write-constants", help="write the engine constants as JSON for simulate.py --engine-constants")
    args = ap.parse_args(argv)
    try:
        base = load_run(args.baseline)
        pairs = [(base, load_run(args.tail_batching))] + [(load_run(b), load_run(t)) for b, t in args.check]
        skip = warmup_steps(base)
        max_num_seqs = int(base.config.get("rollout", {}).get("max_num_seqs", 256))
        engine, rms = fit_engine(base, args.prompt_tokens, max_num_seqs, skip)
        train, reward = fit_train(base, args.prompt_tokens, skip)
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    print(f"fitted on {base.path} (warm-up steps left out: {sorted(skip) or 'none'}; "
          f"prompt {args.prompt_tokens} tokens)")
    print(f"  engine: decode iteration {engine.step_s * 1e3:.2f} ms + {engine.per_seq_s * 1e6:.1f} us/seq + "
          f"{engine.per_ctx_token_s * 1e9:.2f} ns/ctx token; admission {engine.prefill_token_s * 1e6:.2f} us/prompt "
          f"token; finish-time RMS error {rms * 1e3:.0f} ms")
    print(f"  training (train + old logprobs): {train.s_per_token * 1e6:.1f} us/token, fixed {train.fixed_s:+.2f} s "
          f"(relative to prompt + response tokens); weight sync {train.sync_s:.3f} s; "
          f"reward {reward.median_s * 1e3:.2f} ms/response")
    if args.write_constants:
        Path(args.write_constants).write_text(json.dumps(engine.to_dict(), indent=2) + "\n")
        print(f"  engine constants written to {args.write_constants}")
    worst = 0.0
    for b, t in pairs:
        pr = predict_pair(engine, train, reward, b, t, args.prompt_tokens, args.seeds)
        ph = pr.phases
        worst = max(worst, abs(pr.error))
        print(f"\n{b.path} vs {t.path}")
        for name in ("baseline", "tail"):
            print(f"  {name:<8} loop predicted {getattr(pr, name + '_s'):6.1f} s  measured "
                  f"{getattr(pr, 'measured_' + name + '_s'):6.1f} s   rollout {ph[name + '/rollout']:5.1f} vs "
                  f"{ph[name + '/rollout measured']:5.1f} s   train {ph[name + '/train']:5.1f} vs "
                  f"{ph[name + '/train measured']:5.1f} s")
        print(f"  speedup predicted {pr.predicted:.3f} (seeds {min(pr.seed_speedups):.3f}..{max(pr.seed_speedups):.3f})"
              f"  measured {pr.measured:.3f}  (all steps {b.loop_s / t.loop_s:.3f})  error {pr.error:+.1%}  "
              f"{'within' if abs(pr.error) <= args.tolerance else 'OUTSIDE'} {args.tolerance:.0%}")
    print(f"\nmax error: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

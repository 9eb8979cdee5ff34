"""Print the resolved plan of a GPU recipe without launching anything: parallel layout, what runs
on each node and GPU, and a per-GPU memory estimate; exit code 2 when it does not fit.

    rollpacker-plan-cluster --config examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml \
        [--hosts n1,n2,n3,n4] [--gpu h800] [section.key=value ...]

Needs neither torch nor a GPU, so it runs on a login node (the Slurm scripts' --dry-run uses it).
"""
from __future__ import annotations

import argparse
import sys

from megatron_rl.config.loading import load_config
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.memory import GPUS, MemoryAssumptions
from megatron_rl.planning.plan import make_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe")
    parser.add_argument("--hosts", default="", help="comma-separated node hostnames (default node0..nodeN-1)")
    parser.add_argument("--gpu", default="h800", choices=sorted(GPUS), help="accelerator model (memory capacity)")
    parser.add_argument("--no-engine-sleep", action="store_true",
                        help="what-if: engines keep their memory pool while the trainer trains")
    parser.add_argument("--assume-trainer-offload", action="store_true",
                        help="what-if: estimate as if trainer.offload_during_rollout were true (trainer state "
                             "in host memory during rollout); the recipe's field drives it otherwise")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.num_nodes=4")
    args = parser.parse_args(argv)
    assume = MemoryAssumptions(engine_sleeps_during_training=not args.no_engine_sleep,
                               trainer_offload_during_rollout=args.assume_trainer_offload)
    try:
        cfg = load_config(args.config, args.overrides)
        hosts = [h for h in args.hosts.split(",") if h] or None
        plan = make_plan(cfg, hosts, args.gpu, assume)
    except ConfigError as exc:
        print(f"plan error ({args.config}): {exc}", file=sys.stderr)
        return 2
    print(f"recipe: {args.config}")
    print("\n".join(plan.lines()))
    print("plan: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

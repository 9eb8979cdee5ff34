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

import rollpacker.plugins  # noqa: F401  (RollPacker's config sections, as megatron_rl.train registers them)
from megatron_rl.config import RunConfig
from megatron_rl.config_io import apply_override, load_config
from megatron_rl.tools import REPO_ROOT as REPO


def period_steps(eta_prompts: float, prompts_per_step: int) -> int:
    """Steps of one tail-batching period: short rounds until the queue holds P0, then a long one."""
    queued_per_short = math.ceil(eta_prompts * prompts_per_step) - prompts_per_step
    if queued_per_short <= 0:
        return 1  # eta_P = 1: no queue, every round is short
    return math.ceil(prompts_per_step / queued_per_short) + 1


def benchmark_config(args, scheduler: str, steps: int, run_dir: Path, extra: list[str] = ()) -> RunConfig:
    """The CPU recipe (examples/qwen2.5/tiny_cpu.yaml) shaped by the benchmark's options: model,
    prompts x responses, lengths, evaluation at the end, no checkpoints; ``extra`` then the
    command line's overrides go last."""
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu.yaml")
    for assignment in [
        f"model.hf_path={args.model}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        f"scheduler.name={scheduler}", f"data.prompts_per_step={args.prompts_per_step}",
        f"data.responses_per_prompt={args.responses}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"data.eval_every={steps}", f"data.eval_num_prompts={args.eval_prompts}",
        "trainer.save_every=0", "trainer.tensorboard=false", f"trainer.seed={args.seed}",
        f"rollout.max_num_seqs={args.max_num_seqs}", *extra, *args.overrides,
    ]:
        apply_override(cfg, assignment)
    return cfg


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
    steps = args.periods * period_steps(probe.tail_batching.eta_prompts, args.prompts_per_step)
    return steps, max(args.prompts_per_step, round(steps * args.prompts_per_step / args.epochs))


def spread(values: list, fmt: str = "{:.2f}") -> str:
    """``median [min-max]`` of the numbers among ``values`` (just the median when they agree), '-'
    when there are none: one cell of a benchmark table over several runs."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return "-"
    med, lo, hi = statistics.median(values), min(values), max(values)
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"

"""``rollpacker-benchmark --compare cumulative``: what each RollPacker mechanism adds, measured.

Four columns on the same model, prompts and seeds, each adding one mechanism to the one before
(the paper's cumulative table, on this machine's real stack):

* ``tail``: tail batching alone;
* ``+planner``: + the elastic-TP planner (``planner.*`` as examples/qwen2.5/tiny_cpu_full.yaml:
  short rounds from TP2, long rounds from TP1, growth 1.05, 4 quiet rounds);
* ``+stream``: + the stream trainer (``stream.*`` as tiny_cpu_full: long rounds, one of the two
  engines released to the trainer);
* ``+spec``: + suffix speculative decoding of the long rounds and history routing.

Every column shares tiny_cpu_full's non-mechanism keys (:data:`SHARED`: two engines, engine sleep
through training, trainer offload during rollout), so ``+spec`` is that recipe's mechanism set.
Defaults: the heavy-tail model ``artifacts/tiny-qwen2.5-rechecks``, 3 seeds (``--seeds``) x 2
passes (``--runs``); within each (pass, seed) the columns run back to back, ABCD on one and DCBA
on the next, so a drift of the machine's speed hits every column alike.

Prints every run's figures, then per column the median [range] over runs of loop time, its split,
the speedup over ``tail`` and over the previous column (each ratio within its own (pass, seed)),
decode steps and the mechanism counters (planner switches and their time, released engines,
accepted drafts), and beside it the simulator's cumulative figures for the 7B/14B/32B recipes
(simulated H800 clusters, not measured). Writes every raw figure with the command line, date,
commit, CPU and model hash to <out>/cumulative.json (``--record``: docs/results/cumulative.json,
then ``python -m rollpacker.benchmarks.cumulative_table`` renders docs/results/cumulative.md), and
each run's figures to <out>/runs.jsonl as it ends (kept when the benchmark is interrupted).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rollpacker.benchmarks.benchmark_speculative import column_figures
from rollpacker.benchmarks.common import (
    REPO,
    add_run_options,
    check_run_options,
    column_run_config,
    interleaved_order,
    ratio_line,
    run_columns,
    run_shape,
    spread,
)

SHARED = ["rollout.num_engines=2", "rollout.sleep_during_train=true", "rollout.sleep_level=2",
          "trainer.offload_during_rollout=true"]
"""tiny_cpu_full's keys that are no mechanism under test: the same in every column (two engines
give the planner a TP2 to switch to and the stream trainer an engine to release)."""

MECHANISMS: list[tuple[str, list[str], list[str]]] = [
    ("tail", [], ["planner.enabled=false", "stream.enabled=false", "rollout.speculative.method=off",
                  "tail_batching.history_routing=false"]),
    ("+planner", ["planner.enabled=true", "planner.initial_tp=short:2,long:1", "planner.growth=1.05",
                  "planner.quiet_rounds=4"], []),
    ("+stream", ["stream.enabled=true", "stream.rounds=long", "stream.start_fraction_min=0.2",
                 "stream.start_fraction_max=0.5", "stream.check_interval=0.05", "stream.release_engines=1",
                 "stream.train_threads=2"], []),
    ("+spec", ["rollout.speculative.method=suffix", "rollout.speculative.rounds=long",
               "tail_batching.history_routing=true"], []),
]
"""(column, the keys it turns on, the keys ``tail`` pins off): each column is the one before plus its keys."""


def build_columns() -> list[tuple[str, str, list[str]]]:
    """(name, scheduler, overrides) of each column: shared keys, every mechanism off, then the
    mechanisms of this column and the ones before it switched on (later assignments win)."""
    off = [a for _, _, pins in MECHANISMS for a in pins]
    columns, on = [], []
    for name, keys, _ in MECHANISMS:
        on = on + keys
        columns.append((name, "tail_batching", [*SHARED, *off, *on]))
    return columns


COLUMNS = build_columns()
NAMES = [c[0] for c in COLUMNS]
SIM_RECIPES = ["examples/qwen2.5/qwen2.5_7b_mixed_2x8_tp2_rtp1.yaml", "examples/qwen2.5/qwen2.5_14b_mixed_4x8_tp4_rtp2.yaml",
               "examples/qwen2.5/qwen2.5_32b_mixed_8x8_tp8_rtp2.yaml"]
"""The paper's three sizes; its cumulative table is on a math+code+QA mix, as these recipes."""


def run_figures(rows: list[dict]) -> dict:
    """One run's figures: :func:`column_figures` plus the planner's and stream trainer's counters."""
    fig = column_figures(rows)
    fig.pop("curves")

    def total(key: str, sel=rows) -> float:
        return sum(float(r.get(key, 0.0)) for r in sel)

    short = [r for r in rows if r["round_type"] != "long"]
    fig.update(
        short_rounds=len(short), rollout_short=fig["split"]["rollout_short"], rollout_long=fig["split"]["rollout_long"],
        short_decode_steps=total("rollout/spec/decode_steps", short),
        planner_switches=total("planner/switched"), engine_switch_s=total("time/engine_switch"),
        preemptions=total("planner/preemptions") if any("planner/preemptions" in r for r in rows) else None,
        released_engines=total("stream/released_engines"), stream_rounds=total("stream/started"),
        stream_hidden_train_s=total("stream/hidden_train_s"), stream_exposed_train_s=total("stream/exposed_train_s"),
        migrated_requests=total("stream/migrated_requests"), release_s=total("stream/release_s"),
        engine_sleep_s=total("time/engine_sleep"), trainer_reload_s=total("time/trainer_reload"))
    return fig


def add_ratios(runs: dict[str, dict[str, dict]]) -> None:
    """Per run: ``speedup`` (tail / column loop time) and ``step_gain`` (previous column / column),
    both within the run's own (pass, seed)."""
    for cols in runs.values():
        prev = None
        for name in NAMES:
            fig = cols[name]
            fig["speedup"] = cols[NAMES[0]]["loop_time"] / fig["loop_time"]
            fig["step_gain"] = prev["loop_time"] / fig["loop_time"] if prev else 1.0
            prev = fig


ROWS = [("training-loop time (s)", "loop_time", "{:.1f}"), ("speedup vs tail", "speedup", "{:.2f}"),
        ("gain over previous column", "step_gain", "{:.2f}"),
        ("rollout time, short rounds (s)", "rollout_short", "{:.1f}"),
        ("rollout time, long rounds (s)", "rollout_long", "{:.1f}"),
        ("scoring time (s)", ("split", "scoring"), "{:.1f}"), ("train time (s)", ("split", "train"), "{:.1f}"),
        ("weight sync time (s)", ("split", "weight_sync"), "{:.1f}"), ("other time (s)", ("split", "other"), "{:.1f}"),
        ("decode steps, short rounds", "short_decode_steps", "{:.0f}"),
        ("decode steps, long rounds", "long_decode_steps", "{:.0f}"),
        ("planner switches", "planner_switches", "{:.0f}"), ("engine switch time (s)", "engine_switch_s", "{:.1f}"),
        ("preemptions (planner's count)", "preemptions", "{:.0f}"),
        ("released engines (stream)", "released_engines", "{:.0f}"),
        ("stream: train hidden (s)", "stream_hidden_train_s", "{:.1f}"),
        ("stream: train exposed (s)", "stream_exposed_train_s", "{:.1f}"),
        ("accepted draft tokens", "accepted_tokens", "{:.0f}"), ("acceptance", "acceptance", "{:.3f}"),
        ("train reward (mean)", "train_reward", "{:.3f}"), ("val pass@1 (end)", "pass@1", "{:.3f}")]
"""(title, figure key, format) of the table rows; a tuple key reads ``fig[a][b]``."""


def figure(fig: dict, key):
    return fig[key[0]][key[1]] if isinstance(key, tuple) else fig.get(key)


def print_table(title: str, runs: list[dict[str, dict]]) -> None:
    print(f"\n{title}")
    print(f"| {'figure':<32} | " + " | ".join(f"{n:>22}" for n in NAMES) + " |")
    print("| " + "-" * 32 + " | " + " | ".join("-" * 21 + ":" for _ in NAMES) + " |")
    for row_title, key, fmt in ROWS:
        cells = [spread([figure(cols[n], key) for cols in runs], fmt) for n in NAMES]
        print(f"| {row_title:<32} | " + " | ".join(f"{c:>22}" for c in cells) + " |")


def simulated(acceptance: float | None, spec_tokens: int, steps: int = 40) -> dict[str, list[dict]]:
    """The simulator's cumulative table (rollpacker.simulator.runner.cumulative) for each of
    :data:`SIM_RECIPES` on H800s with its paper-like lengths; speculation is added with the
    acceptance measured here, when there is one."""
    from megatron_rl.config.loading import load_config
    from megatron_rl.planning.architectures import resolve_shape
    from megatron_rl.planning.memory import GPUS
    from rollpacker.simulator.lengths import LogNormalLengths
    from rollpacker.simulator.runner import build_cluster, cumulative

    out = {}
    for recipe in SIM_RECIPES:
        cfg = load_config(REPO / recipe)
        shape = resolve_shape(cfg.model.hf_path)
        lengths = LogNormalLengths.paper_like(cfg.rollout.max_new_tokens, cfg.data.max_prompt_tokens // 2)
        cluster = build_cluster(cfg, shape, GPUS["h800"], lengths)
        spec = (acceptance, spec_tokens) if acceptance else None
        table = cumulative(cluster, steps, 0, 1.25, 1.25, spec)
        out[recipe] = [{"policy": s.name, "step_s": s.mean_step_s, "short_s": s.mean_of("short"),
                        "long_s": s.mean_of("long"), "speedup": table[0].mean_step_s / s.mean_step_s,
                        "bubble": s.bubble_fraction, "preemptions_per_step": sum(x.preemptions for x in s.steps) / steps}
                       for s in table]
    return out


def provenance(argv: list[str], model: str) -> dict:
    """Command line, UTC date, commit, CPU, load average and the model's hash of a recorded result."""
    from megatron_rl.model.fingerprint import model_record

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").is_file() else "unknown"
    return {"command": "rollpacker-benchmark --compare cumulative " + " ".join(argv), "load_average_start": os.getloadavg(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "commit": git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""),
            "hardware": {"cpu": cpu, "cores": os.cpu_count()}, "model": model_record(model)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "runs/benchmark_cumulative"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2, help="passes over the seeds (each column runs seeds x runs times)")
    parser.add_argument("--record", action="store_true", help="write the results to docs/results/cumulative.json")
    parser.add_argument("--columns", type=int, default=len(NAMES),
                        help="run only the first N columns (a quick estimate; the record needs all)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.runs < 1:
        parser.error("--seeds and --runs must be >= 1")
    if not 1 <= args.columns <= len(NAMES):
        parser.error(f"--columns must be 1..{len(NAMES)}")
    if args.record and args.columns != len(NAMES):
        parser.error("--record needs every column")
    return args


def run_order(passes: int, seeds: list[int]) -> list[tuple[int, int, list[str]]]:
    return interleaved_order(passes, seeds, NAMES)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if error := check_run_options(args):
        print(error, file=sys.stderr)
        return 2
    names = NAMES[:args.columns]
    steps, num_prompts = run_shape(args)
    first_seed = args.seed
    log = Path(args.out) / "runs.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    current: dict = {}

    def config_for(a, column: str, seed: int, run_dir: Path):
        current.update(column=column, seed=seed, run_dir=str(run_dir))
        return column_run_config(a, COLUMNS, column, seed, run_dir, 2)

    def figures_of(rows: list[dict]) -> dict:
        fig = run_figures(rows)
        with log.open("a") as f:  # what an interrupted benchmark measured stays on disk
            f.write(json.dumps({**current, **fig}) + "\n")
        return fig

    started = provenance(argv, args.model)  # the commit and date the runs start from
    runs = run_columns(args, names, config_for, figures_of)
    args.seed = first_seed
    print(f"\nmodel {args.model}; {args.seeds} seed(s) from {first_seed} x {args.runs} pass(es); {steps} steps per run; "
          f"P0={args.prompts_per_step}, R0={args.responses}, {num_prompts} prompts, max_new_tokens={args.max_new_tokens}")
    for name, _, overrides in COLUMNS[:len(names)]:
        print(f"  {name}: {' '.join(overrides)}")
    for label, cols in runs.items():
        print(f"  {label}: " + ", ".join(f"{n} {cols[n]['loop_time']:.1f} s ({cols[n]['wall_time_with_startup']:.0f} s "
                                         "with start-up)" for n in names))
    if len(names) < len(NAMES):  # an estimate: per-run wall times are what it is for
        return 0
    add_ratios(runs)
    every = list(runs.values())
    for label, cols in runs.items():
        print_table(label, [cols])
    print_table(f"median [range] over {len(every)} runs", every)
    acceptance = statistics.median([c["+spec"]["acceptance"] for c in every if c["+spec"]["acceptance"]] or [0.0])
    from megatron_rl.config.schema import SpeculativeConfig
    sim = simulated(acceptance or None, SpeculativeConfig().num_speculative_tokens)
    print(f"\nSIMULATED (H800 clusters of the 7B/14B/32B recipes, paper-like lengths; not measured here); "
          f"speculation at the acceptance measured above ({acceptance:.3f}):")
    for recipe, table in sim.items():
        print(f"  {Path(recipe).stem}: " + "; ".join(f"{s['policy']} x{s['speedup']:.2f}" for s in table))
    result = {**started, "load_average_end": os.getloadavg(), "args": vars(args), "steps": steps, "num_prompts": num_prompts,
              "columns": {name: overrides for name, _, overrides in COLUMNS}, "runs": runs, "simulated": sim}
    path = REPO / "docs/results/cumulative.json" if args.record else Path(args.out) / "cumulative.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nresults: {path}")
    for name in NAMES[1:]:
        print(ratio_line(f"gain of {name} over the column before", [c[name]["step_gain"] for c in every]))
    print(ratio_line("speedup (tail / +spec)", [c["+spec"]["speedup"] for c in every]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cluster what-if simulator: baseline (veRL-style) vs RollPacker for a recipe, mechanism by
mechanism, with an eta_P x eta_R sweep and the paper's figures side by side.

    rollpacker-simulate --recipe examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml
    rollpacker-simulate --recipe R.yaml --metrics runs/x/metrics.jsonl      # replay a run's lengths
    rollpacker-simulate --recipe R.yaml --lengths lengths.jsonl            # {"prompt_id","length"} rows
    rollpacker-simulate --recipe examples/qwen2.5/tiny_cpu.yaml --engine-constants cpu.json \
        --train-s-per-token 2e-5                                                # calibrated CPU run
    rollpacker-simulate --paper-check [--record docs/results/simulator_paper.json]   # against the paper

Prints the assumed inputs (with the cost of one weight sync per ``rollout.weight_sync_format``,
``megatron_rl.planning.weight_sync_cost``), a table (step time, bubble fraction, short/long
rounds, speedup), the sweep, the seconds per step spent on weight sync with files vs tensors (the
whole policy rerun with each format's sync), and a last line ``speedup: X.XX`` (baseline step
time / full RollPacker step time, with the recipe's own format).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from megatron_rl.config.loading import load_config
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.memory import GPUS
from megatron_rl.planning.weight_sync_cost import describe as describe_sync
from megatron_rl.planning.weight_sync_cost import sync_seconds
from rollpacker.simulator.costs import TrainModel
from rollpacker.simulator.engine_model import EngineModel, GpuEfficiency
from rollpacker.simulator.lengths import EmpiricalLengths, LengthModel, LogNormalLengths
from rollpacker.simulator.runner import PAPER_CUMULATIVE, PAPER_ITERATION_S, build_cluster, cumulative, sweep


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="YAML recipe (cluster shape, layouts, batch, lengths cap)")
    ap.add_argument("--paper-check", action="store_true",
                    help="simulate the paper's 7B/14B/32B setup and print simulated vs paper per bar, with the sensitivity "
                         "to each uncertain input (rollpacker/simulator/paper_check.py); no recipe needed")
    ap.add_argument("--record", metavar="PATH", help="with --paper-check: write the results file "
                                                     "(docs/results/simulator_paper.json)")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. rollout.max_new_tokens=8192")
    ap.add_argument("--gpu", default="h800", choices=sorted(GPUS))
    ap.add_argument("--steps", type=int, default=40, help="steps per policy (a multiple of the short+long period)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eta-p", type=float, default=1.25, help="prompt over-provisioning eta_P of the table")
    ap.add_argument("--eta-r", type=float, default=1.25, help="response over-provisioning eta_R of the table")
    ap.add_argument("--sweep-eta-p", type=_floats, default=[1.0, 1.25, 1.5], help="eta_P values of the sweep")
    ap.add_argument("--sweep-eta-r", type=_floats, default=[1.0, 1.25, 1.5], help="eta_R values of the sweep")
    g = ap.add_argument_group("response lengths (default: paper-like lognormal long tail)")
    g.add_argument("--metrics", help="fit the length model to a run's metrics.jsonl")
    g.add_argument("--lengths", help="replay lengths: ints per line, or jsonl {prompt_id, length}")
    g.add_argument("--median-tokens", type=float, help="lognormal median response length")
    g.add_argument("--sigma-prompt", type=float, default=0.9)
    g.add_argument("--sigma-response", type=float, default=0.7)
    g.add_argument("--prompt-tokens", type=int, default=0, help="prompt length (default: half of max_prompt_tokens)")
    c = ap.add_argument_group("calibration (measured constants replace the GPU model)")
    c.add_argument("--engine-constants", help="JSON of EngineModel constants measured on the target machine")
    c.add_argument("--train-s-per-token", type=float, default=0.0, help="measured training seconds per token")
    c.add_argument("--train-fixed-s", type=float, default=None, help="measured fixed seconds per train step")
    c.add_argument("--sync-s", type=float, default=None, help="measured weight-sync seconds per step")
    c.add_argument("--spec-acceptance", type=float, default=None,
                   help="speculative decoding of long rounds: per-draft-token acceptance measured by "
                        "rollpacker-benchmark --compare speculative (rollout/spec/acceptance_rate); adds a row")
    c.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per step with --spec-acceptance")
    c.add_argument("--mfu", type=float, default=0.4, help="assumed training MFU (GPU model)")
    c.add_argument("--hbm-efficiency", type=float, default=0.7, help="assumed decode HBM efficiency (GPU model)")
    return ap.parse_args(argv)


def _lengths(args: argparse.Namespace, max_new: int, prompt_tokens: int) -> LengthModel:
    if args.lengths:
        return EmpiricalLengths.from_file(args.lengths, max_new, prompt_tokens)
    if args.metrics:
        return LogNormalLengths.from_metrics(args.metrics, max_new, prompt_tokens)
    base = LogNormalLengths.paper_like(max_new, prompt_tokens)
    return replace(base, median_tokens=args.median_tokens or base.median_tokens, sigma_prompt=args.sigma_prompt,
                   sigma_response=args.sigma_response)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.paper_check:
        from rollpacker.benchmarks import simulate_paper

        check, sens = simulate_paper.compute(args.steps, args.seed)
        simulate_paper.print_report(check, sens)
        if args.record:
            simulate_paper.record(args.record, check, sens, args.steps, args.seed,
                                  "rollpacker-simulate --paper-check" + ("" if args.steps == 40 else f" --steps {args.steps}")
                                  + f" --record {args.record}")
            print(f"results: {args.record}")
        return 0
    if args.record or not args.recipe:
        print("simulate: " + ("--record needs --paper-check" if args.record else "--recipe is required (or --paper-check)"),
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.recipe, args.overrides)
        shape = resolve_shape(cfg.model.hf_path)
        gpu = GPUS[args.gpu]
        prompt_tokens = args.prompt_tokens or cfg.data.max_prompt_tokens // 2
        lengths = _lengths(args, cfg.rollout.max_new_tokens, prompt_tokens)
        engine = EngineModel.from_json(args.engine_constants) if args.engine_constants else None
        train = TrainModel.from_recipe(cfg, shape, gpu, mfu=args.mfu)
        if args.train_s_per_token:
            train = replace(train, s_per_token=args.train_s_per_token)
        if args.train_fixed_s is not None:
            train = replace(train, fixed_s=args.train_fixed_s)
        if args.sync_s is not None:
            train = replace(train, sync_s=args.sync_s)
        eff = GpuEfficiency(hbm=args.hbm_efficiency)
        cluster = build_cluster(cfg, shape, gpu, lengths, engine=engine, train=train, eff=eff)
    except (ConfigError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    e0 = cluster.engine_for_tp(cluster.base_tp)
    planner = cluster.make_planner()
    sizes = "/".join(map(str, planner.sizes))
    print(f"recipe: {args.recipe}")
    print("assumed inputs:")
    print(f"  model {shape.name} ({shape.total_params / 1e9:.2f}B); {cluster.rollout_gpus} rollout GPUs as "
          f"{cluster.rollout_gpus // e0.gpus} engines x TP{cluster.base_tp} (planner TP {sizes}, growth "
          f"{planner.growth:g}, quiet rounds {planner.quiet_rounds}); "
          f"P0={cluster.prompts_per_step} R0={cluster.responses_per_prompt}")
    source = f"measured constants {args.engine_constants}" if engine else (
        f"{gpu.name} roofline, HBM eff {eff.hbm}, decode MFU {eff.decode_mfu}, TP eff {eff.tp_efficiency}/doubling")
    print(f"  engine ({source}): step {e0.step_s * 1e3:.2f} ms + {e0.per_seq_s * 1e6:.1f} us/seq + "
          f"{e0.per_ctx_token_s * 1e9:.2f} ns/ctx token; prefill {e0.prefill_token_s * 1e6:.2f} us/token; "
          f"KV {e0.kv_capacity_tokens:,} tokens; max_num_seqs {e0.max_num_seqs}")
    t = cluster.train
    train_desc = (f"measured {t.s_per_token:g} s/token" if t.s_per_token else
                  f"FLOPs on {t.gpus} GPUs at MFU {t.mfu}, PP {t.pp} bubble")
    print(f"  training: {train_desc}, fixed {t.fixed_s:g} s, weight sync {t.sync_s:.1f} s"
          + ("" if args.sync_s is not None else f" ({cfg.rollout.weight_sync_format})"))
    sync = {fmt: sync_seconds(cfg, shape, fmt) for fmt in ("sharded", "hf", "tensor")}
    print(f"  weight sync per step by format (bf16; assumed {describe_sync()}):")
    for fmt, phases in sync.items():
        split = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "total" and v)
        print(f"    {fmt:<8} {phases['total']:7.2f} s  ({split})")
    rw = cluster.reward
    print(f"  reward: {rw.describe()}")
    print(f"  lengths: {lengths.describe()}")
    print(f"  {args.steps} steps per policy, seed {args.seed}, table at eta_P={args.eta_p:g} eta_R={args.eta_r:g}")

    spec = (args.spec_acceptance, args.spec_tokens) if args.spec_acceptance is not None else None
    if spec is not None:
        from rollpacker.simulator.speculation import expected_tokens_per_step

        print(f"  speculation in long rounds: acceptance {spec[0]:g} per draft token, {spec[1]} drafts/step -> "
              f"{expected_tokens_per_step(*spec):.2f} tokens/step/sequence; verification charged k+1 tokens of "
              "compute per sequence, weights read once (rollpacker/simulator/speculation.py)")
    table = cumulative(cluster, args.steps, args.seed, args.eta_p, args.eta_r, spec)
    base = table[0]
    print("\npolicy                 (mean over steps)")
    for s in table:
        print(s.line(base))
    size = re.search(r"(\d+)b", shape.name.lower())
    paper = PAPER_CUMULATIVE.get(f"{size.group(1)}b") if size else None
    if paper:
        print(f"\nvs the paper ({shape.name}; its inputs: 16x8 H800, math+code+QA mix, vLLM 0.8.4):")
        for s in [s for s in table[1:] if s.name in paper]:
            print(f"  {s.name:<22} simulated x{base.mean_step_s / s.mean_step_s:.2f}   paper x{paper[s.name]:.2f}")
        no_tb, tb = PAPER_ITERATION_S[f"{size.group(1)}b"]
        print(f"  iteration time: simulated {base.mean_step_s:.0f} s -> {table[1].mean_step_s:.0f} s with tail batching; "
              f"paper {no_tb:.0f} s -> {tb:.0f} s")

    print("\neta sweep (all mechanisms on):")
    for ep, er, s in sweep(cluster, args.steps, args.seed, args.sweep_eta_p, args.sweep_eta_r):
        print(f"  {s.line(base)}")
    if args.sync_s is None:
        print("\nweight sync, files vs tensors (the whole policy and veRL's baseline, same seeds):")
        for fmt, phases in sync.items():
            runs = cumulative(replace(cluster, train=replace(cluster.train, sync_s=phases["total"])), args.steps,
                              args.seed, args.eta_p, args.eta_r)
            share = lambda s: sum(x.sync_s for x in s.steps) / sum(x.step_s for x in s.steps)  # noqa: E731
            print(f"  {fmt:<8} {phases['total']:6.2f} s per sync, {runs[-1].sync_per_step:6.2f} s/step spent on "
                  f"weight sync (TP switches sync again): RollPacker step {runs[-1].mean_step_s:6.1f} s "
                  f"({share(runs[-1]):5.1%} sync), baseline {runs[0].mean_step_s:6.1f} s ({share(runs[0]):5.1%})")
    print(f"\nspeedup: {base.mean_step_s / table[-1].mean_step_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The run config of one benchmark run of the real loop: the CPU recipe (examples/qwen2.5/tiny_cpu.yaml)
shaped by a benchmark's options. The core's benchmarks use it, and RollPacker's comparisons import it from here."""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config.loading import apply_override, load_config
from megatron_rl.config.schema import RunConfig
from megatron_rl.tools import REPO_ROOT as REPO


def benchmark_config(args, scheduler: str, steps: int, run_dir: Path, extra: list[str] = ()) -> RunConfig:
    """The CPU recipe (examples/qwen2.5/tiny_cpu.yaml) shaped by the benchmark's options: model,
    prompts x responses, lengths, evaluation at the end, no checkpoints, the engines' iteration
    trace on (``rollout.engine_trace``: what ``rollpacker-price`` prices); ``extra`` then the
    command line's overrides go last (``rollout.engine_trace=false`` turns the trace off)."""
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu.yaml")
    for assignment in [
        f"model.hf_path={args.model}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}",
        f"scheduler.name={scheduler}", f"data.prompts_per_step={args.prompts_per_step}",
        f"data.responses_per_prompt={args.responses}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"data.eval_every={steps}", f"data.eval_num_prompts={args.eval_prompts}",
        "trainer.save_every=0", "trainer.tensorboard=false", f"trainer.seed={args.seed}",
        f"rollout.max_num_seqs={args.max_num_seqs}", "rollout.engine_trace=true", *extra, *args.overrides,
    ]:
        apply_override(cfg, assignment)
    return cfg

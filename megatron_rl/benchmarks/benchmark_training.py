"""How close the loop's training comes to a plain torch step over the same model and batches.

    python -m megatron_rl.benchmarks.benchmark_training --run RUN_DIR [--threads 1,2] [--steps 10]

Replays the shapes a finished run trained (``trained_prompts.jsonl`` records each step's
(prompt, response) token counts) through the simplest training step torch offers on this
machine: the same Hugging Face checkpoint (``model.hf_path`` of the run) in transformers, fp32,
the same token-budget microbatches (``optimizer.micro_batch_tokens``, the trainer's own packing),
forward, per-token log-softmax of the labels, a masked mean loss, backward, one AdamW step. Token
ids are random (speed does not depend on them). Each ``--threads`` setting is one arm (torch
intra-op threads of the one process), steps interleaved across arms so drift hits all alike.

Further arms run the trainer's own step (``MegatronWorker.train_step``, Megatron-Core at TP 1
with the run's loss) on the same shapes in this process, one per ``--threads`` setting, so the
table separates what the trainer's code costs from what the run's parallel layout costs, and
shows what one trainer rank given every thread would reach against the run's threads per rank
(its ranks' torch threads as the run recorded them, ``train/torch_threads``: one on CPU unless
``MEGATRON_RL_NUM_THREADS`` says otherwise).

Prints per arm the tokens per second (prompt + response tokens of the step over its time; median
and range over steps) beside the run's own ``train/tokens_per_s`` (Megatron-Core, the run's TP/PP
layout, gloo), and a last line ``training fraction of plain torch: X`` (the run's median over the
best arm's median).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def step_shapes(run_dir: Path) -> list[list[tuple[int, int]]]:
    """Per trained step, the (prompt tokens, response tokens) of every trained sample."""
    rows = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines() if line.strip()]
    shapes = [[(int(p), int(r)) for p, r in row["lengths"]] for row in rows if row.get("lengths")]
    if not shapes:
        raise SystemExit(f"{run_dir}/trained_prompts.jsonl has no 'lengths' (a run from before they were recorded)")
    return shapes


def torch_step(model, optimizer, shapes: list[tuple[int, int]], budget: int, vocab: int, rng: random.Random) -> float:
    """One plain training step over ``shapes``; returns its seconds."""
    import torch

    from megatron_rl.training.packing import pack_microbatches

    lengths = [p + r for p, r in shapes]
    start = time.perf_counter()
    for members in pack_microbatches(lengths, budget):
        longest = max(lengths[i] for i in members)
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(longest)] for _ in members])
        attention = torch.zeros_like(tokens)
        loss_mask = torch.zeros(len(members), longest - 1)
        for row, i in enumerate(members):
            prompt, response = shapes[i]
            attention[row, :prompt + response] = 1
            loss_mask[row, prompt - 1:prompt + response - 1] = 1.0
        logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(logp * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def threads_label(threads: list[float]) -> str:
    """The run's torch threads per trainer rank, from its steps' ``train/torch_threads``."""
    if not threads:
        return "threads per rank not recorded"
    low, high = int(min(threads)), int(max(threads))
    return f"{low} thread(s) per rank" if low == high else f"{low}-{high} threads per rank"


class MegatronArm:
    """The trainer's own step (``MegatronWorker.train_step``: Megatron-Core TP 1, the run's loss,
    the CPU device mode) in this process, on the same shapes and threads as the plain arms: what
    the trainer's code costs over plain torch, apart from the run's parallel layout."""

    def __init__(self, run_cfg: dict, rng: random.Random, vocab: int) -> None:
        import functools

        from megatron_rl.algorithms.losses import compute_policy_loss
        from megatron_rl.config.loading import apply_override, load_config
        from megatron_rl.distributed.cpu_shim import apply_cpu_shim, cpu_device_mode
        from megatron_rl.distributed.ports import free_port
        from megatron_rl.training.megatron_worker import MegatronWorker

        apply_cpu_shim()
        cfg = load_config(None)
        for key in ("hf_path", "dtype", "local_attention"):
            apply_override(cfg, f"model.{key}={run_cfg['model'][key]}")
        apply_override(cfg, f"optimizer.micro_batch_tokens={run_cfg['optimizer']['micro_batch_tokens']}")
        self.mode, self.rng, self.vocab = cpu_device_mode, rng, vocab
        with cpu_device_mode():
            self.worker = MegatronWorker(cfg, 0, 1, "127.0.0.1", free_port())
            self.worker.load_hf(cfg.model.hf_path)
        self.loss_fn = functools.partial(compute_policy_loss, cfg=cfg.algorithm)

    def step(self, shapes: list[tuple[int, int]]) -> float:
        from megatron_rl.sample import Prompt, Sample

        rng, samples = self.rng, []
        for i, (p, r) in enumerate(shapes):
            prompt = Prompt(prompt_id=f"b:{i}", token_ids=[rng.randrange(self.vocab) for _ in range(p)], answer="")
            samples.append(Sample(prompt=prompt, response_index=0, response_ids=[rng.randrange(self.vocab) for _ in range(r)],
                                  engine_logprobs=[-1.0] * r, advantage=rng.uniform(-1, 1)))
        start = time.perf_counter()
        with self.mode():
            self.worker.train_step(samples, self.loss_fn)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a finished run directory (metrics.jsonl, trained_prompts.jsonl)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one arm each")
    parser.add_argument("--steps", type=int, default=10, help="steps of the run to replay (from the first)")
    parser.add_argument("--no-megatron", dest="megatron", action="store_false",
                        help="skip the arm that runs the trainer's own step (Megatron-Core TP1) in this process")
    args = parser.parse_args(argv)
    run_dir = Path(args.run)
    cfg = json.loads((run_dir / "config.json").read_text())
    shapes = step_shapes(run_dir)[: args.steps]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    loop = [m["train/tokens_per_s"] for m in metrics[: len(shapes)] if "train/tokens_per_s" in m]
    rank_threads = threads_label([m["train/torch_threads"] for m in metrics[: len(shapes)] if "train/torch_threads" in m])
    arms = [int(t) for t in args.threads.split(",") if t]

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg["model"]["hf_path"], torch_dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["lr"])
    budget, vocab = int(cfg["optimizer"]["micro_batch_tokens"]), model.config.vocab_size
    rng = random.Random(0)
    rates: dict[int, list[float]] = {n: [] for n in arms}
    megatron = MegatronArm(cfg, rng, vocab) if args.megatron else None
    mega_rates: dict[int, list[float]] = {n: [] for n in arms}
    torch.set_num_threads(max(arms))
    torch_step(model, optimizer, shapes[0], budget, vocab, rng)  # warm-up, not timed
    if megatron is not None:
        megatron.step(shapes[0])
    for i, step in enumerate(shapes):
        tokens = sum(p + r for p, r in step)
        for n in (arms if i % 2 == 0 else arms[::-1]):
            torch.set_num_threads(n)
            rates[n].append(tokens / torch_step(model, optimizer, step, budget, vocab, rng))
            if megatron is not None:
                mega_rates[n].append(tokens / megatron.step(step))
    layout = cfg["parallel"]
    print(f"model {cfg['model']['hf_path']}; {len(shapes)} steps of {run_dir}; micro_batch_tokens={budget}")
    print("| arm | tokens/s, median [range] |\n| --- | ---: |")
    for n in arms:
        print(f"| plain torch, 1 process x {n} thread(s) | {statistics.median(rates[n]):.0f} "
              f"[{min(rates[n]):.0f}-{max(rates[n]):.0f}] |")
    for n, mega in mega_rates.items():
        if mega:
            print(f"| the trainer's step in this process: Megatron-Core TP1, {n} thread(s) | {statistics.median(mega):.0f} "
                  f"[{min(mega):.0f}-{max(mega):.0f}] |")
    if loop:
        print(f"| the run: Megatron-Core TP{layout['tensor_model_parallel_size']} PP{layout['pipeline_model_parallel_size']} "
              f"DP{layout['data_parallel_size']} ({rank_threads}) | {statistics.median(loop):.0f} "
              f"[{min(loop):.0f}-{max(loop):.0f}] |")
        best = max(statistics.median(rates[n]) for n in arms)
        print(f"training fraction of plain torch: {statistics.median(loop) / best:.2f}")
    else:
        print("the run's metrics carry no train/tokens_per_s (a run from before it was recorded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the tiny Qwen2.5-architecture model for the default CPU run.

    megatron-rl-make-tiny-model --out artifacts/tiny-qwen2.5 [--seed 0] [--sft-steps N]

A random-init model gets no reward, so GRPO would have nothing to learn from. This tool
supervised-fine-tunes the random model on the built-in arithmetic task's train split (prompt
through the chat template, loss on the reference solution + <|im_end|> only) just long enough
that it solves some held-out problems greedily but not most, and fewer when sampling at
temperature 1: the spread of rewards inside a group is what GRPO learns from. It then prints
greedy/sampled accuracy and the model's own response lengths (max/median: the long tail).

Deterministic for a seed at a fixed thread count (``--threads``). The output directory is
written to a temporary sibling first and swapped in at the end, so an interrupted run never
leaves a half-written model behind.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rl.data import arithmetic
from megatron_rl.data.datasets import BUILTIN_TASK_SEED, apply_chat_template

SFT_INDEX_OFFSET = 1_000_000
"""SFT problems start at this train-split index, away from the RL prompt set (indices
0 .. data.builtin_num_prompts); the test split is disjoint from both by construction."""


@dataclass
class ModelShape:
    """Architecture of the tiny model (head_dim = hidden / heads = 32, so TP=2 and vLLM work)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 1024


@dataclass
class SFTReport:
    """What the run did and how well the result solves held-out problems."""

    out_dir: str
    seed: int
    sft_steps: int
    final_loss: float
    train_seconds: float
    greedy_accuracy: float
    sampled_accuracy: float
    eval_prompts: int
    response_len_median: float
    response_len_max: int
    sampled_len_median: float = 0.0
    sampled_len_max: int = 0
    recheck_rate: float = 0.0
    recheck_continue: float = 0.0
    build: dict = None  # type: ignore[assignment]
    """What the weights depend on besides the arguments above: torch threads, batch size, lr,
    shape, torch version, the CPU kernels torch picked (``torch.backends.cpu.get_cpu_capability``),
    and the sha256 of the written weights (``megatron_rl.model.fingerprint``), so a figure can
    say exactly which model it was measured with."""


@dataclass
class RecheckStyle:
    """The verbose style (``arithmetic.verbose_solution``) some SFT targets get: a fraction
    ``rate`` of examples re-check the running sum 1 + Geometric(``continue_prob``) times, within
    ``max_response_tokens``. rate 0 (the default model) leaves every target as it was."""

    rate: float = 0.0
    continue_prob: float = 0.9
    max_response_tokens: int = 736  # + the longest prompt (~230 tokens) stays within 1024 positions

    def solution(self, problem: arithmetic.ArithmeticProblem, seed: int) -> str:
        if self.rate <= 0:
            return problem.solution
        answer_line = problem.solution.split("\n")[-1]
        one_pass = len(arithmetic.RECHECK_LINE) + 1 + len(problem.solution) - len(answer_line)
        max_passes = (self.max_response_tokens - len(problem.solution)) // one_pass  # byte-level: 1 char = 1 token
        rng = random.Random(f"recheck:{seed}:{problem.index}")
        passes = arithmetic.sample_recheck_passes(rng, self.rate, self.continue_prob, max_passes)
        return arithmetic.verbose_solution(problem, passes)


def _encode_example(problem: arithmetic.ArithmeticProblem, tokenizer, eos_id: int,
                    solution: str | None = None) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one SFT example: labels are -100 on the prompt, so only the
    solution (``problem.solution`` unless given) and its <|im_end|> are learned."""
    prompt = apply_chat_template(tokenizer, problem.question)
    response = tokenizer.encode(solution or problem.solution, add_special_tokens=False) + [eos_id]
    return prompt + response, [-100] * len(prompt) + response


def _micro_batches(examples: list[tuple[list[int], list[int]]], token_budget: int) -> list[list[tuple[list[int], list[int]]]]:
    """Length-sorted micro-batches of at most ``token_budget`` padded tokens each.

    The long tail makes a random batch mostly padding (median 102 tokens, max ~600); sorting
    first keeps the compute close to the real token count.
    """
    batches: list[list] = []
    current: list = []
    for example in sorted(examples, key=lambda e: len(e[0])):
        # Sorted ascending, so the newest example sets the padded width of the batch.
        if current and len(example[0]) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(example)
    if current:
        batches.append(current)
    return batches


def _pad(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 on padding)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def _lr_at(step: int, total: int, peak: float) -> float:
    """Warm-up over the first 5% of steps, hold the peak, then decay linearly over the last
    20% to 10% of the peak. Holding the peak matters: the model only "gets" carrying and
    term lookup after a few hundred steps at a high rate, which cosine decay cuts short."""
    warmup = max(1, total // 20)
    decay_start = total - max(1, total // 5)
    if step < warmup:
        return peak * (step + 1) / warmup
    if step < decay_start:
        return peak
    return peak * (1.0 - 0.9 * (step - decay_start) / max(1, total - decay_start))


def train_sft(
    model, tokenizer, seed: int, steps: int, batch_size: int, lr: float, progress: bool, token_budget: int = 4096,
    style: RecheckStyle | None = None,
) -> float:
    """Fine-tune ``model`` in place on fresh train-split problems; returns the last loss."""
    import torch
    from tqdm import tqdm

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.pad_token_id
    style = style or RecheckStyle()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc="SFT", disable=not progress, dynamic_ncols=True)
    for step in bar:
        # Fresh problems every step, in a fixed order: the data order is a function of the seed.
        start = SFT_INDEX_OFFSET + step * batch_size
        problems = arithmetic.make_problems(batch_size, seed=seed, split="train", start=start)
        examples = [_encode_example(p, tokenizer, eos_id, style.solution(p, seed)) for p in problems]
        num_targets = sum(sum(1 for t in lab if t != -100) for _, lab in examples)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in _micro_batches(examples, token_budget):
            input_ids, mask, labels = _pad(micro, pad_id)
            logits = model(input_ids=input_ids, attention_mask=mask).logits
            # Token mean over the whole step (not per micro-batch), so every target token counts
            # the same however the batch was split.
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
            ) / num_targets
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = total
        bar.set_postfix(loss=f"{loss_value:.3f}")
    model.eval()
    return loss_value


def generate_responses(model, tokenizer, questions: list[str], sample: bool, seed: int, max_new_tokens: int) -> list[str]:
    """Responses of ``model`` (greedy, or temperature-1 sampling without top-k/top-p)."""
    import torch

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.pad_token_id
    prompts = [apply_chat_template(tokenizer, q) for q in questions]
    width = max(len(p) for p in prompts)
    # Left padding so every row's last position is its own last prompt token.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            eos_token_id=[eos_id, pad_id],
            pad_token_id=pad_id,
        )
    responses = []
    for row in out[:, width:].tolist():
        ids = []
        for token in row:
            if token in (eos_id, pad_id):
                break
            ids.append(token)
        responses.append(tokenizer.decode(ids))
    return responses


def evaluate(model, tokenizer, num_prompts: int, seed: int, max_new_tokens: int = 0) -> dict:
    """Greedy and sampled accuracy on the first ``num_prompts`` test problems, plus the
    greedy and sampled response lengths in tokens (byte-level tokenizer: one character, one
    token). ``max_new_tokens`` 0: the longest reference solution plus slack."""
    problems = arithmetic.make_problems(num_prompts, seed=BUILTIN_TASK_SEED, split="test")
    questions = [p.question for p in problems]
    # Room for the longest reference solution plus slack, so long answers are not cut short.
    budget = max_new_tokens or max(len(p.solution) for p in problems) + 64
    greedy = generate_responses(model, tokenizer, questions, sample=False, seed=seed, max_new_tokens=budget)
    sampled = generate_responses(model, tokenizer, questions, sample=True, seed=seed, max_new_tokens=budget)
    lengths = [len(tokenizer.encode(r, add_special_tokens=False)) + 1 for r in greedy]
    sampled_lengths = [len(tokenizer.encode(r, add_special_tokens=False)) + 1 for r in sampled]
    return {
        "sampled_len_median": statistics.median(sampled_lengths),
        "sampled_len_max": max(sampled_lengths),
        "greedy_accuracy": sum(arithmetic.score(r, p.answer) for r, p in zip(greedy, problems)) / num_prompts,
        "sampled_accuracy": sum(arithmetic.score(r, p.answer) for r, p in zip(sampled, problems)) / num_prompts,
        "response_len_median": statistics.median(lengths),
        "response_len_max": max(lengths),
    }


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    sft_steps: int = 400,
    batch_size: int = 32,
    lr: float = 3e-3,
    eval_prompts: int = 48,
    num_threads: int = 2,
    shape: ModelShape | None = None,
    progress: bool = True,
    style: RecheckStyle | None = None,
) -> SFTReport:
    """Build, fine-tune, evaluate and atomically save the tiny model to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from megatron_rl.model.tiny import build_tiny_qwen2

    if sft_steps < 0 or batch_size <= 0 or eval_prompts <= 0:
        raise ValueError(f"need sft_steps >= 0, batch_size > 0, eval_prompts > 0; got {sft_steps}, {batch_size}, {eval_prompts}")
    shape = shape or ModelShape()
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # Process-wide torch settings: restored afterwards so importing callers (tests) are unaffected.
    saved_threads, saved_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        build_tiny_qwen2(
            tmp,
            seed=seed,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            intermediate_size=shape.intermediate_size,
            max_position_embeddings=shape.max_position_embeddings,
            tie_word_embeddings=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = Qwen2ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        torch.manual_seed(seed)
        start = time.monotonic()
        style = style or RecheckStyle()
        loss = train_sft(model, tokenizer, seed, sft_steps, batch_size, lr, progress, style=style)
        train_seconds = time.monotonic() - start
        metrics = evaluate(model, tokenizer, eval_prompts, seed, style.max_response_tokens if style.rate > 0 else 0)
        report = SFTReport(
            out_dir=str(out),
            seed=seed,
            sft_steps=sft_steps,
            final_loss=loss,
            train_seconds=round(train_seconds, 1),
            eval_prompts=eval_prompts,
            recheck_rate=style.rate,
            recheck_continue=style.continue_prob if style.rate > 0 else 0.0,
            **metrics,
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        from megatron_rl.model.fingerprint import weights_sha256

        report.build = {"threads": num_threads, "batch_size": batch_size, "lr": lr, "shape": asdict(shape),
                        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "weights_sha256": weights_sha256(tmp)}
        (tmp / "make_tiny_model.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_deterministic)
    return report


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace ``out`` with ``tmp`` by renames (a directory cannot be os.replace'd over a
    non-empty one), so readers see either the old model or the new one."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--seed", type=int, default=0, help="init, data order and sampling seed")
    parser.add_argument("--sft-steps", type=int, default=400, help="supervised steps (batch of --batch-size problems)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--eval-prompts", type=int, default=48, help="held-out test problems to score")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    parser.add_argument("--recheck-rate", type=float, default=0.0,
                        help="fraction of SFT targets in the verbose re-checking style (0: none; see RecheckStyle)")
    parser.add_argument("--recheck-continue", type=float, default=0.9,
                        help="probability of each further re-check pass in those targets")
    args = parser.parse_args(argv)
    if not 0.0 <= args.recheck_rate <= 1.0 or not 0.0 <= args.recheck_continue < 1.0:
        parser.error("--recheck-rate must be in [0, 1] and --recheck-continue in [0, 1)")
    report = make_tiny_model(
        args.out,
        seed=args.seed,
        sft_steps=args.sft_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_prompts=args.eval_prompts,
        num_threads=args.threads,
        style=RecheckStyle(rate=args.recheck_rate, continue_prob=args.recheck_continue),
    )
    print(
        f"saved {report.out_dir} after {report.sft_steps} SFT steps ({report.train_seconds:.0f} s, "
        f"final loss {report.final_loss:.3f})\n"
        f"test accuracy on {report.eval_prompts} prompts: greedy {report.greedy_accuracy:.0%}, "
        f"sampled (T=1) {report.sampled_accuracy:.0%}\n"
        f"greedy response length (tokens): median {report.response_len_median:g}, max {report.response_len_max}; "
        f"sampled: median {report.sampled_len_median:g}, max {report.sampled_len_max}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

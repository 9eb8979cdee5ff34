"""The per-step record of the loop: time split, reward, lengths, occupancy, engine parity.

Pure functions of a step's batch and timings, so the loop stays short and this stays testable.
"""
from __future__ import annotations

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import RolloutBatch
from megatron_rl.rollout.engine import EngineStats
from megatron_rl.runtime.metrics_logger import length_stats, occupancy
from megatron_rl.sample import Sample


def parity_metrics(trained: list[Sample], train_metrics: dict) -> dict[str, float]:
    """Trainer vs engine logprobs of the same tokens (catches stale or mis-mapped weight syncs):
    from the scoring pass's old logprobs or, with algorithm.recompute_old_logprobs=false, from
    the training forward (its ``logprob_abs_diff_*`` sums, taken out of ``train_metrics``). Only
    on-policy tokens count (``Sample.staleness`` 0): an older policy's engine logprobs differ by
    design. No on-policy token: no parity figures."""
    if "logprob_abs_diff_sum" in train_metrics:
        diff_sum = train_metrics.pop("logprob_abs_diff_sum")
        diff_max = train_metrics.pop("logprob_abs_diff_max", 0.0)
        counted = train_metrics.pop("logprob_abs_diff_tokens", train_metrics.get("num_tokens", 0.0))
        if not counted:
            return {}
        return {"rollout/logprob_abs_diff_max": diff_max, "rollout/logprob_abs_diff_mean": diff_sum / counted}
    diffs = [abs(a - b) for s in trained if s.engine_logprobs
             for a, b, lag in zip(s.old_logprobs, s.engine_logprobs, s.staleness or [0] * len(s.old_logprobs))
             if lag == 0]
    if not diffs:
        return {}
    return {"rollout/logprob_abs_diff_max": max(diffs), "rollout/logprob_abs_diff_mean": sum(diffs) / len(diffs)}


def step_metrics(cfg: RunConfig, step: int, version: int, batch: RolloutBatch, trained: list[Sample],
                 phases: dict[str, float], elapsed: float) -> dict:
    """The step's core record. ``phases`` are the timed phases (rollout, logprob, train,
    weight_sync, ...); the rollout's reward tail is split out as ``time/reward``."""
    samples = batch.samples
    lengths = [len(s.response_ids) for s in samples]
    rewards = [s.reward for s in samples]
    last_finish = max((s.timings.get("finished", 0.0) for s in samples), default=batch.rollout_window[1])
    phases = dict(phases)
    # Rewards are computed while generation runs; only the wait after the last response counts,
    # and only as far as the step waited for it (a rollout that overlapped the previous step's
    # training, one-step-off, was scored there).
    reward_tail = max(0.0, batch.rollout_window[1] - last_finish) if samples else 0.0
    reward_tail = min(reward_tail, phases.get("rollout", 0.0))
    phases["rollout"] = max(0.0, phases.get("rollout", 0.0) - reward_tail)
    phases["reward"] = reward_tail
    # Generation throughput over the time the batch was generating, inside this step or not.
    generating = max(phases["rollout"], batch.rollout_window[1] - batch.rollout_window[0] - reward_tail)
    capacity = cfg.rollout.max_num_seqs * cfg.rollout.num_engines
    m = {
        "step": step,
        "policy_version": version,
        "round_type": batch.round_type,
        "time/step": elapsed,
        **{f"time/{k}": v for k, v in phases.items()},
        "reward/mean": sum(rewards) / max(1, len(rewards)),
        "reward/accuracy": sum(bool(s.correct) for s in samples) / max(1, len(samples)),
        "rollout/tokens_per_s": sum(lengths) / max(1e-9, generating),
        "rollout/engine_occupancy": occupancy([(s, e) for s, e, _ in batch.requests], capacity, batch.rollout_window),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / max(1, len(samples)),
        "batch/samples_trained": float(len(trained)),
        "batch/tokens_trained": float(sum(len(s.prompt.token_ids) + len(s.response_ids) for s in trained)),
        "batch/response_tokens_trained": float(sum(len(s.response_ids) for s in trained)),
    }
    if phases.get("train"):
        # Training throughput (prompt + response tokens through forward and backward): what
        # megatron_rl/benchmarks/benchmark_training.py holds against a plain torch step over the same shapes.
        m["train/tokens_per_s"] = m["batch/tokens_trained"] / phases["train"]
    stats = length_stats(lengths)
    m.update({f"response_length/{k}": v for k, v in stats.items()})
    # Short and long rounds are bimodal: also report step time and lengths per round type.
    rt = batch.round_type
    m[f"round/{rt}/time_step"] = elapsed
    m[f"round/{rt}/time_rollout"] = phases["rollout"]
    m.update({f"round/{rt}/response_length_{k}": v for k, v in stats.items()})
    m.update(batch.metrics)
    return m


def speculation_metrics(batch: RolloutBatch, before: EngineStats, after: EngineStats) -> dict[str, float]:
    """``rollout/spec/*`` of the step's rollout (decode steps, drafts, acceptance) from the engine
    counters read around it, also under ``round/<type>/spec_*`` since only some round types
    speculate. Generated tokens: every kept response plus the tokens of aborted requests."""
    generated = sum(len(s.response_ids) for s in batch.samples) + int(batch.metrics.get("rollout/aborted_tokens", 0.0))
    m = spec_counter_metrics(before, after, generated)
    rt = batch.round_type
    m.update({f"round/{rt}/spec_{k.rsplit('/', 1)[1]}": v for k, v in list(m.items())
              if k.endswith(("acceptance_rate", "decode_steps", "tokens_per_step"))})
    return m


def spec_counter_metrics(before: EngineStats, after: EngineStats, generated_tokens: int) -> dict[str, float]:
    """``rollout/spec/*`` of one rollout from the engine counters around it (``EngineStats``, counted
    in the engine by ``rollout.actor.speculative.SpecCounters``).

    ``generated_tokens``: every token the round generated (kept, discarded and aborted responses),
    so ``tokens_per_step`` is the decode efficiency the drafts bought (1.0 without speculation
    for a single sequence; more with several sequences per step or accepted drafts)."""
    steps = after.decode_steps - before.decode_steps
    drafts = after.drafts - before.drafts
    draft = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    return {
        "rollout/spec/decode_steps": float(steps),
        "rollout/spec/drafts": float(drafts),
        "rollout/spec/draft_tokens": float(draft),
        "rollout/spec/accepted_tokens": float(accepted),
        "rollout/spec/acceptance_rate": accepted / draft if draft else 0.0,
        # Tokens a drafted request-step produced: the accepted drafts plus the token sampled after them.
        "rollout/spec/mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        "rollout/spec/tokens_per_step": generated_tokens / steps if steps else 0.0,
    }


def trained_prompt_record(batch: RolloutBatch, trained: list[Sample]) -> dict[str, list]:
    """Which prompts the step trained, and which it dropped on purpose (DAPO refill filter or the
    loop's zero-variance filter): the audit trail of trained_prompts.jsonl."""
    prompt_ids = list(dict.fromkeys(s.prompt.prompt_id for s in trained))
    kept = set(prompt_ids)
    filtered = list(batch.filtered_prompt_ids) + [g[0].prompt.prompt_id for g in batch.groups
                                                  if g[0].prompt.prompt_id not in kept]
    # The trained shapes (prompt, response tokens per sample): megatron_rl/benchmarks/benchmark_training.py
    # replays them through a plain torch step.
    return {"prompt_ids": prompt_ids, "filtered_ids": filtered,
            "lengths": [[len(s.prompt.token_ids), len(s.response_ids)] for s in trained]}


def timeline_record(batch: RolloutBatch, t0: float) -> dict:
    """Every request of the round with times relative to the trainer's start, so steps line up on
    one axis in rollpacker-plot-timeline."""
    return {"round_type": batch.round_type, "window": [t - t0 for t in batch.rollout_window],
            "requests": [[s - t0, e - t0, reason] for s, e, reason in batch.requests],
            "response_lengths": [len(s.response_ids) for s in batch.samples]}

"""A trainer rank's share of a batch, as padded microbatches: which samples this data-parallel rank
takes (balanced by tokens over the DP ranks) and the microbatches they pack into, with the per-token
and per-sequence fields the loss reads. Pure functions of the samples and the layout, so every rank of
a DP replica (its TP and PP ranks) builds the same microbatches without talking to the others."""
from __future__ import annotations

from megatron_rl.config.schema import RunConfig
from megatron_rl.sample import Sample
from megatron_rl.training.packing import (
    Microbatch,
    balance_across_ranks,
    build_microbatch,
    pack_microbatches,
    sequence_multiple,
)


def optional_field(samples: list[Sample], name: str) -> list[list[float]] | None:
    """Per-sample list field, None when no sample has it; an error when only some do."""
    present = [bool(getattr(s, name)) or not s.response_ids for s in samples]
    if not any(bool(getattr(s, name)) for s in samples):
        return None
    if not all(present):
        bad = present.index(False)
        raise ValueError(f"sample {bad} ({samples[bad].prompt.prompt_id}) has no {name} while others do")
    return [list(getattr(s, name)) for s in samples]


def rank_share(lengths: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the samples (by token count ``lengths``) DP rank ``dp_rank`` of ``dp_size`` takes:
    balanced by tokens; with fewer samples than ranks (a small stream chunk, a logprob call) the
    first ranks take one each and the others none (they skip the compute)."""
    if len(lengths) >= dp_size:
        return balance_across_ranks(lengths, dp_size)[dp_rank]
    return [dp_rank] if dp_rank < len(lengths) else []


def rank_microbatches(samples: list[Sample], mine: list[int], cfg: RunConfig, tp_size: int,
                      fields: bool) -> list[Microbatch]:
    """``samples[i]`` for ``i`` in ``mine`` as padded microbatches of at most
    ``optimizer.micro_batch_tokens`` (indices refer to ``samples``); with ``fields``, the loss's
    per-token fields (old, reference and engine logprobs, staleness) and advantages, checked first."""
    lengths = [s.num_tokens for s in samples]
    # Under sequence parallelism every width must divide by TP (see packing.sequence_multiple).
    multiple = sequence_multiple(tp_size, cfg.parallel.sequence_parallel)
    groups = pack_microbatches([lengths[i] for i in mine], cfg.optimizer.micro_batch_tokens, multiple)
    token_fields: dict[str, list[list[float]] | None] = {}
    seq_fields: dict[str, list[float]] = {}
    if fields:
        recompute = cfg.algorithm.recomputes_old_logprobs()  # else the training forward's own
        if not recompute and any(s.old_logprobs for s in samples):
            raise ValueError("samples carry old_logprobs but algorithm.recompute_old_logprobs resolves to false "
                             "(one optimizer step: the training forward's own logprobs are the old ones); set "
                             "algorithm.recompute_old_logprobs=true to train against given old logprobs")
        for i, s in enumerate(samples):
            if recompute and s.response_ids and len(s.old_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {i} ({s.prompt.prompt_id}, response {s.response_index}): old_logprobs has "
                    f"{len(s.old_logprobs)} values for {len(s.response_ids)} response tokens"
                )
        token_fields = {"old_logprobs": [list(s.old_logprobs) for s in samples] if recompute else None,
                        "ref_logprobs": optional_field(samples, "ref_logprobs"),
                        "engine_logprobs": optional_field(samples, "engine_logprobs"),
                        # Only when some token is off-policy (the loop sets it then): which
                        # tokens the parity check may hold against the engine.
                        "staleness": optional_field(samples, "staleness")}
        seq_fields = {"advantages": [s.advantage for s in samples]}
    out = []
    for group in groups:
        idx = [mine[j] for j in group]
        out.append(build_microbatch(
            [(samples[i].prompt.token_ids, samples[i].response_ids) for i in idx], idx,
            token_fields={k: [v[i] for i in idx] for k, v in token_fields.items() if v is not None},
            seq_fields={k: [v[i] for i in idx] for k, v in seq_fields.items()},
            width_multiple=multiple,
        ))
    return out


def replica_shares(lengths: list[int], replicas: list[int], prior: dict[int, float] | None = None) -> dict[int, list[int]]:
    """Indices of the samples (by token count ``lengths``) each of ``replicas`` (DP indices) takes when
    the driver splits a chunk over some replicas: longest first, each to the replica with the least
    tokens so far, counting ``prior`` (tokens each replica already trained this step: the replicas the
    rollout freed stream before the others come back, so after the round the split evens the totals
    and the replicas finish together). Deterministic; each replica's indices come back sorted."""
    if not replicas:
        raise ValueError("replica_shares: no replica to split over")
    loads = {r: float((prior or {}).get(r, 0.0)) for r in replicas}
    parts: dict[int, list[int]] = {r: [] for r in replicas}
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        replica = min(replicas, key=lambda r: (loads[r], len(parts[r]), r))
        parts[replica].append(index)
        loads[replica] += lengths[index]
    return {r: sorted(p) for r, p in parts.items()}

"""Dynamic batching for the trainer: DP balancing, token-budget microbatches, padded tensors.

Pure logic, no torch.distributed. Layout choice: each microbatch is a right-padded
``[num_seqs, max_len]`` batch run with a causal mask. Right padding plus causality means no real
token ever attends to another sequence or to padding, so the same code is exact on Megatron's
local spec (CPU) and on Transformer Engine; the price is the padding, which the token budget
counts (``num_seqs * max_len``) and which sorting by length keeps small. THD packing without
padding would need TE's packed-sequence attention and is not used.

Token alignment: logits at position t predict token t+1, so for a sequence with P prompt and
R response tokens the response logprobs come from positions P-1 .. P+R-2. Every per-token
tensor built here (``labels``, ``loss_mask`` and the per-token fields) is laid out on those
positions.

Sequence parallelism: with ``parallel.sequence_parallel`` Megatron splits the sequence dimension
of every microbatch over the TP ranks, and its scatter / reduce-scatter assert that the length
divides by TP (``_split_along_first_dim`` and ``_reduce_scatter_along_first_dim`` in
megatron/core/tensor_parallel/mappings.py). Microbatch widths are therefore rounded up to
:func:`sequence_multiple`; the extra columns are padding like any other (masked out of the loss
and of the returned logprobs) and count against the token budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


def balance_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Split sequence indices over DP ranks with near-equal token totals (greedy LPT).

    Longest first, each to the currently lightest rank (ties: lowest rank), so the heaviest rank
    carries at most 4/3 of the optimum. Deterministic; each rank's indices come back sorted.
    Raises when there are fewer sequences than ranks (every rank must train on something).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if len(lengths) < num_ranks:
        raise ValueError(
            f"{len(lengths)} sequences cannot be spread over {num_ranks} data-parallel ranks; "
            "use a batch (or mini-batch) of at least data_parallel_size sequences"
        )
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], len(parts[r]), r))
        parts[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(p) for p in parts]


def sequence_multiple(tp_size: int, sequence_parallel: bool) -> int:
    """What every microbatch width must divide by: TP under sequence parallelism, else 1.

    Megatron scatters the [S, B, H] embeddings along S over the TP group and reduce-scatters the
    row-parallel outputs along S; both assert ``S % TP == 0`` (megatron/core/tensor_parallel/
    mappings.py). Without sequence parallelism every TP rank holds the whole sequence.
    """
    if tp_size < 1:
        raise ValueError(f"parallel.tensor_model_parallel_size must be >= 1, got {tp_size}")
    return tp_size if sequence_parallel else 1


def padded_width(longest: int, multiple: int = 1) -> int:
    """Width of a microbatch whose longest sequence has ``longest`` tokens: rounded up to ``multiple``."""
    if multiple < 1:
        raise ValueError(f"width multiple must be >= 1, got {multiple}")
    return -(-longest // multiple) * multiple


def pack_microbatches(lengths: Sequence[int], token_budget: int, width_multiple: int = 1) -> list[list[int]]:
    """Group sequence indices into microbatches whose padded size fits ``token_budget``.

    Padded size = number of sequences x width, the width being the longest sequence rounded up
    to ``width_multiple`` (:func:`padded_width`; see :func:`sequence_multiple`). First-fit
    decreasing: sequences are visited longest first, so a microbatch's first member is its
    longest and adding one more costs exactly ``(n + 1) * width``. A sequence whose width
    exceeds the budget gets a microbatch of its own (sequences are never split). Deterministic.
    """
    if token_budget < 1:
        raise ValueError(f"optimizer.micro_batch_tokens must be >= 1, got {token_budget}")
    bins: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for members in bins:
            if (len(members) + 1) * padded_width(lengths[members[0]], width_multiple) <= token_budget:
                members.append(index)
                break
        else:
            bins.append([index])
    return bins


@dataclass
class Microbatch:
    """Right-padded tensors of one microbatch (B rows, L columns)."""

    tokens: torch.Tensor
    """[B, L] int64 input tokens (prompt + response, then padding)."""
    position_ids: torch.Tensor
    """[B, L] int64, 0.. per row (restart per sequence)."""
    labels: torch.Tensor
    """[B, L] int64, the next token at each position (0 where there is none)."""
    loss_mask: torch.Tensor
    """[B, L] float, 1 at positions whose label is a response token."""
    segment_ids: torch.Tensor
    """[B, L] int64, the sample index (position in the caller's list) for real tokens, -1 for padding."""
    seq_ids: torch.Tensor
    """[B] int64, the sample index of each row."""
    response_lengths: list[int]
    """Response tokens per row."""
    prompt_lengths: list[int]
    """Prompt tokens per row."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token float tensors [B, L] aligned with ``labels`` (e.g. old_logprobs, advantages)."""

    def to(self, device: torch.device | str) -> "Microbatch":
        """A copy with every tensor on ``device`` (the model's device)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Microbatch(
            tokens=move(self.tokens), position_ids=move(self.position_ids), labels=move(self.labels),
            loss_mask=move(self.loss_mask), segment_ids=move(self.segment_ids), seq_ids=self.seq_ids,
            response_lengths=self.response_lengths, prompt_lengths=self.prompt_lengths,
            fields={k: move(v) for k, v in self.fields.items()},
        )

    @property
    def num_response_tokens(self) -> int:
        """Tokens the loss sees in this microbatch."""
        return int(sum(self.response_lengths))


def build_microbatch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    sample_indices: Sequence[int],
    token_fields: dict[str, Sequence[Sequence[float]]] | None = None,
    seq_fields: dict[str, Sequence[float]] | None = None,
    pad_id: int = 0,
    width_multiple: int = 1,
) -> Microbatch:
    """Build the padded tensors of one microbatch.

    ``sequences[i]`` is ``(prompt_ids, response_ids)`` of sample ``sample_indices[i]``. The width
    is the longest sequence rounded up to ``width_multiple`` (:func:`sequence_multiple`).
    ``token_fields[name][i]`` gives one value per response token (laid out on the label
    positions); ``seq_fields[name][i]`` one value per sequence, broadcast over its response tokens.
    Errors name the field and the sample index.
    """
    token_fields = token_fields or {}
    seq_fields = seq_fields or {}
    rows = len(sequences)
    if rows == 0:
        raise ValueError("a microbatch needs at least one sequence")
    width = padded_width(max(len(p) + len(r) for p, r in sequences), width_multiple)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    segment_ids = torch.full((rows, width), -1, dtype=torch.long)
    fields = {name: torch.zeros((rows, width), dtype=torch.float32) for name in [*token_fields, *seq_fields]}
    prompt_lengths, response_lengths = [], []
    for row, ((prompt, response), sample) in enumerate(zip(sequences, sample_indices)):
        if len(prompt) == 0:
            raise ValueError(f"sample {sample}: empty prompt (the first response token needs a context)")
        n_p, n_r = len(prompt), len(response)
        total = n_p + n_r
        tokens[row, :total] = torch.tensor([*prompt, *response], dtype=torch.long)
        labels[row, : total - 1] = tokens[row, 1:total]
        span = slice(n_p - 1, n_p - 1 + n_r)
        loss_mask[row, span] = 1.0
        segment_ids[row, :total] = sample
        for name, values in token_fields.items():
            if len(values[row]) != n_r:
                raise ValueError(
                    f"sample {sample}: field {name!r} has {len(values[row])} values for {n_r} response tokens"
                )
            fields[name][row, span] = torch.tensor(values[row], dtype=torch.float32)
        for name, values in seq_fields.items():
            fields[name][row, span] = float(values[row])
        prompt_lengths.append(n_p)
        response_lengths.append(n_r)
    position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(rows, -1).contiguous()
    return Microbatch(
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        segment_ids=segment_ids,
        seq_ids=torch.tensor(list(sample_indices), dtype=torch.long),
        response_lengths=response_lengths,
        prompt_lengths=prompt_lengths,
        fields=fields,
    )


def response_values(per_token: torch.Tensor, batch: Microbatch) -> list[list[float]]:
    """Per-row response values (e.g. logprobs) from a [B, L] tensor laid out like ``labels``."""
    out = []
    for row, (n_p, n_r) in enumerate(zip(batch.prompt_lengths, batch.response_lengths)):
        out.append(per_token[row, n_p - 1 : n_p - 1 + n_r].tolist())
    return out

"""Per-token logprobs from a Megatron GPTModel, and the microbatch runner shared by the
forward-only (logprob) and training passes.

Logprobs come from Megatron's vocab-parallel cross entropy on the TP-sharded logits (the full
vocabulary is never materialised on one rank). Vocabulary padding rows are masked to -inf
first, so padded entries never enter the softmax normaliser.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megatron_rl.training.packing import Microbatch

# Called on the last PP stage with (microbatch, per-token logprobs [B, L]); returns the
# microbatch loss (a scalar that gets backpropagated, or anything when forward-only) and a
# payload the caller gets back, one per microbatch, in order.
LossCallback = Callable[[Microbatch, torch.Tensor], tuple[torch.Tensor, Any]]


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set logits of padded vocabulary entries (global id >= ``vocab_size``) to -inf.

    ``logits`` is this TP rank's shard [..., V/tp]; returns it unchanged when the shard holds
    no padding.
    """
    shard = logits.shape[-1]
    start = tp_rank * shard
    valid = vocab_size - start
    if valid >= shard:
        return logits
    keep = torch.arange(shard, device=logits.device) < valid
    return logits.masked_fill(~keep, float("-inf"))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """log p(label) per position from TP-sharded logits [B, L, V/tp] and labels [B, L], in fp32."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    masked = mask_vocab_padding(logits.float(), vocab_size, tp_rank)
    return -vocab_parallel_cross_entropy(masked, labels)


def run_microbatches(
    model: torch.nn.Module,
    microbatches: Sequence[Microbatch],
    loss_callback: LossCallback,
    vocab_size: int,
    forward_only: bool,
) -> list[Any]:
    """Run ``microbatches`` through Megatron's forward(-backward) schedule (1F1B under PP).

    Returns the callback payloads on the last PP stage (an empty list elsewhere). With
    ``forward_only=False`` gradients accumulate in the DDP buffers exactly as the sum of the
    callback losses; the model config must have ``calculate_per_token_loss=True`` so Megatron
    does not rescale them (see ``MegatronWorker``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp_rank = ps.get_tensor_model_parallel_rank()
    # Batches are built on the CPU; move each one to the model's device as it is consumed.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def loss_func(batch: Microbatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        logprobs = token_logprobs(output, batch.labels, vocab_size, tp_rank)
        loss, payload = loss_callback(batch, logprobs)
        # The token count is ignored: MegatronWorker's finalize hook does not rescale grads.
        return loss, torch.tensor(batch.num_response_tokens, dtype=torch.int), payload

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        batch = next(data_iterator).to(device)
        output = chunk(batch.tokens, batch.position_ids, None)
        return output, lambda out, batch=batch: loss_func(batch, out)

    if not microbatches:
        return []
    max_len = max(int(mb.tokens.shape[1]) for mb in microbatches)
    with torch.set_grad_enabled(not forward_only):
        payloads = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max_len,  # shapes are exchanged per microbatch (variable_seq_lengths)
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return list(payloads) if ps.is_pipeline_last_stage() else []

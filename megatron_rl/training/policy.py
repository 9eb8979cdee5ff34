"""What the loop needs of the trainer ranks: the :class:`Policy` contract.

``PolicyGroup`` (Megatron workers in Ray actors) implements it for real runs; the loop's fast
test (tests/unit/test_trainer.py) gives the trainer a fake that keeps the same promises. Every
method is a coroutine, so the driver's event loop keeps generating and scoring meanwhile.
"""
from __future__ import annotations

from typing import Protocol

from megatron_rl.sample import Sample


class Policy(Protocol):
    """The policy being trained, as the loop, the weight sync and the colocation owner see it."""

    async def compute_logprobs(self, samples: list[Sample], which: str = "policy",
                               replicas: list[int] | None = None) -> list[list[float]]:
        """Per-token logprobs of each sample's response under the current weights (``'policy'``)
        or the frozen reference model (``'reference'``); one list per sample, one value per
        response token. ``replicas``: only those data-parallel replicas compute (the others may be
        out of device memory)."""
        ...

    async def train_step(self, samples: list[Sample]) -> dict:
        """One training step over ``samples`` (advantages and old logprobs set); returns metrics
        (``loss``, ``grad_norm``, ... and the trainer/engine ``logprob_abs_diff_*`` sums when the
        training forward scored the batch)."""
        ...

    async def accumulate_gradients(self, samples: list[Sample], replicas: list[int] | None = None) -> dict:
        """Forward+backward of ``samples`` added to the pending step's gradient; no optimizer step.
        ``replicas``: only those data-parallel replicas compute, each its own share, evening out what
        each trained since the last optimizer step."""
        ...

    def ranks_of(self, replicas: list[int]) -> list[int]:
        """Global trainer ranks of the data-parallel ``replicas``."""
        ...

    async def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict:
        """The single optimizer step over everything accumulated, normalised by these totals."""
        ...

    async def free_grad_buffers(self) -> dict:
        """Free only the gradient buffers (the first part of :meth:`offload_for_rollout`)."""
        ...

    async def offload_for_rollout(self) -> dict:
        """Move the trainer state out of device memory (``trainer.offload_during_rollout``)."""
        ...

    async def reload_for_training(self, ranks: list[int] | None = None) -> dict:
        """Bring back what :meth:`offload_for_rollout` moved (on every rank, or ``ranks``)."""
        ...

    async def set_num_threads(self, n: int, ranks: list[int] | None = None) -> None:
        """torch intra-op threads on every rank or ``ranks`` (CPU: cores lent by released engines)."""
        ...

    async def write_hf_weights(self, directory: str) -> None:
        """The policy as HF-named safetensors in ``directory`` (replaced atomically)."""
        ...

    async def write_rollout_shards(self, rollout_tp: int, directory: str, version: int,
                                   dtype: str) -> dict[str, float]:
        """The policy as one vLLM rank file per engine rank of TP ``rollout_tp``; returns the
        resharder's figures (bytes_sent, bytes_local, seconds, rounds)."""
        ...

    async def open_weight_push(self, spec: dict) -> list[dict]:
        """Set up a tensor weight push (``rollout.weight_sync.push.protocol.PushSpec`` as a dict) on every
        rank; returns each rank's ring path / IPC handle / plan fingerprint and rank 0's port."""
        ...

    async def join_weight_push(self, key: str, port: int, group_ports: list[int] | None = None) -> None:
        """Every rank enters push ``key``'s groups (while the engines join them); ``group_ports``
        when the spec has its own groups (GPU)."""
        ...

    async def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]:
        """Every rank sends its buckets of push ``key`` (while the engines receive them)."""
        ...

    async def close_weight_push(self, key: str) -> None:
        """Tear push ``key`` down on every rank."""
        ...

    async def rank_nodes(self) -> list[tuple[str, str]]:
        """(Ray node id, IP address) of every rank, in rank order."""
        ...

    async def rank_gpus(self) -> list[str]:
        """GPU UUID of every rank ('' on CPU), in rank order (the tensor push pairs by it)."""
        ...

    async def save_checkpoint(self, directory: str) -> None:
        """Write the trainer state (weights, optimizer, RNG) into ``directory``."""
        ...

    async def load_checkpoint(self, directory: str) -> dict:
        """Restore what :meth:`save_checkpoint` wrote, at the current parallel layout whatever
        layout wrote it; the state is then in device memory. Returns what the load found
        (``steps_done``; for dist checkpoints ``saved_layout`` and ``rng_restored``)."""
        ...

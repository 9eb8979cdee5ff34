"""MegatronWorker: one trainer rank holding the policy (and optional frozen reference) model.

A plain class; the driver wraps it as a Ray actor and calls every method on all ranks (SPMD),
always with the same arguments. Each rank takes its data-parallel share of the samples itself.

The rank is put together from one mixin per concern: building and loading models and checkpoints
(``model_loading``), the gradient steps (``gradient_steps``; its share of a batch comes from
``rank_batches``), the weight export and the tensor push (``weight_export``, ``weight_push``).

Gradient contract of :meth:`train_step`: the loss callable returns a microbatch loss already
divided by the FULL mini-batch's token (or sequence) count, so the sum of microbatch losses over
all microbatches and DP ranks is the mini-batch loss. Megatron is configured not to rescale
anything: ``calculate_per_token_loss=True`` (no division by the number of microbatches, DDP
sums rather than averages over DP) and a finalize hook that skips the per-token division. The
gradient is therefore that of the full mini-batch loss whatever the microbatching, PP or DP.

Streamed accumulation (:meth:`accumulate_gradients` per chunk, then one
:meth:`apply_accumulated_gradients`) computes the same gradient when the batch arrives in pieces
whose totals are unknown until the end: each chunk's losses are raw sums (normalisers 1), the
grad finalisation (DP all-reduce, tied-embedding sync) runs once at the end, and the summed
buffers are scaled by 1/N then. Both finalisation and the loss are linear, so the result equals
the ordinary step up to fp rounding.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_rl.config.schema import RunConfig
from megatron_rl.distributed.cpu_shim import with_cpu_device_mode
from megatron_rl.distributed.process_groups import (
    ParallelLayout,
    destroy_process_groups,
    init_distributed,
    init_model_parallel,
)
from megatron_rl.sample import Sample
from megatron_rl.training.gradient_steps import Accumulation, GradientSteps, LossFn
from megatron_rl.training.logprobs import run_microbatches
from megatron_rl.training.memory_offload import TrainerOffload, with_training_state
from megatron_rl.training.model_loading import ModelLoading
from megatron_rl.training.packing import Microbatch, response_values
from megatron_rl.training.rank_batches import rank_microbatches, rank_share
from megatron_rl.training.weight_export import WeightExport
from megatron_rl.training.weight_push import WeightPush

__all__ = ["LossFn", "MegatronWorker"]


class MegatronWorker(ModelLoading, GradientSteps, WeightExport, WeightPush):
    """One Megatron trainer rank: load HF weights, logprobs, train steps, export, checkpoints."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        torch.set_num_threads(int(os.environ.get("MEGATRON_RL_NUM_THREADS", "1")))
        self.cfg = cfg
        self.rank = rank
        par = cfg.parallel
        self.layout = ParallelLayout(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
        )
        init_distributed(rank, world_size, master_addr, master_port)
        init_model_parallel(self.layout, cfg.trainer.seed)
        from megatron.core import parallel_state as ps

        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.arch = None
        self.steps_done = 0
        self._accumulated: Accumulation | None = None  # None: nothing since the last step
        self._offload = TrainerOffload()  # what offload_for_rollout moved away
        self.rollout_shard_plans: dict = {}  # (arch, rollout TP, dtype) -> RolloutShardPlan

    # ----------------------------------------------------------------- batching
    def _my_microbatches(self, samples: list[Sample], fields: bool) -> list[Microbatch]:
        """This DP rank's share of ``samples`` as padded microbatches (indices refer to ``samples``)."""
        mine = rank_share([s.num_tokens for s in samples], self.dp_rank, self.dp_size)
        return rank_microbatches(samples, mine, self.cfg, self.layout.tensor_model_parallel_size, fields)

    def _is_loss_rank(self) -> bool:
        # One rank per DP replica reports results: the last PP stage's TP rank 0.
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and self.tp_rank == 0

    # ----------------------------------------------------------------- logprobs
    @with_training_state
    def compute_logprobs(self, samples: list[Sample], which: str = "policy",
                         own: bool = False) -> list[list[float]] | None:
        """Per-token logprobs of each sample's response under the policy or the reference model.

        Forward-only through Megatron's schedule (PP microbatches, vocab-parallel CE).
        ``own=False``: every rank is called with the same samples, each DP rank scores its share and
        every rank returns the full list, in the input order (a collective of every rank).
        ``own=True``: ``samples`` are this DP replica's own (the driver split them over the replicas
        that score them, ``PolicyGroup.compute_logprobs``); only its ranks are called, nothing is
        exchanged with another replica, and the replica's reporting rank (the last PP stage's TP rank
        0) returns their list while the others return None.
        """
        model = {"policy": self.model, "reference": self.reference}.get(which)
        if model is None:
            raise ValueError(f"compute_logprobs: no {which!r} model (call load_hf; reference needs "
                             "model.use_reference_model or algorithm.kl_coef > 0)")
        model.eval()
        if own:
            mbs = rank_microbatches(samples, list(range(len(samples))), self.cfg,
                                    self.layout.tensor_model_parallel_size, fields=False)
        else:
            mbs = self._my_microbatches(samples, fields=False)

        def collect(batch: Microbatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return logprobs.sum() * 0.0, dict(zip(batch.seq_ids.tolist(), response_values(logprobs, batch)))

        payloads = run_microbatches(model, mbs, collect, self.arch.vocab_size, forward_only=True)
        mine = {k: v for p in payloads for k, v in p.items()} if self._is_loss_rank() else {}
        if own:
            return [mine[i] for i in range(len(samples))] if self._is_loss_rank() else None
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        merged = {k: v for part in gathered for k, v in part.items()}
        return [merged[i] for i in range(len(samples))]

    @with_cpu_device_mode
    def free_grad_buffers(self) -> dict[str, int]:
        """:meth:`offload_for_rollout`'s first part alone (before a push reading the weights): the grad buffers."""
        if self._accumulated is not None:
            raise RuntimeError("free_grad_buffers: gradients from accumulate_gradients are pending; discard them first")
        return {"grad_buffers_freed": self._offload.free_grad_buffers(self.model)}

    @with_cpu_device_mode
    def offload_for_rollout(self) -> dict[str, int]:
        """``trainer.offload_during_rollout``, after the weight sync: free the grad buffers (the last
        step's gradients are dropped) and, on GPUs, move optimizer state and weights to the host
        (``memory_offload``). Returns this rank's bytes per kind. Training-state calls reload
        themselves (with a warning) if :meth:`reload_for_training` was skipped. Not collective."""
        if self._accumulated is not None:
            raise RuntimeError("offload_for_rollout: gradients from accumulate_gradients are pending; "
                               "apply or discard them first")
        return self._offload.offload(self.model, self.optimizer, self.reference)

    @with_cpu_device_mode
    def reload_for_training(self) -> dict[str, int]:
        """Undo :meth:`offload_for_rollout` (no-op when not offloaded); call before logprobs."""
        return self._offload.reload()

    def shutdown(self, destroy_world: bool = True) -> None:
        """Free the models and tear down Megatron's parallel state (and the world, by default)."""
        self.shutdown_weight_pushes()  # rings out of /dev/shm, push groups left
        self.model = self.reference = self.optimizer = None
        self._accumulated, self._offload = None, TrainerOffload()  # drop host copies too
        destroy_process_groups(destroy_world=destroy_world)

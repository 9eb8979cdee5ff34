"""The trainer's weights (and gradients) out of the Megatron shards: the HF export for the
file-based weight sync and checks, and per-rank vLLM shards through the resharder (the sharded
weight sync and elastic-TP switches). A mixin of :class:`~megatron_rl.training.megatron_worker.MegatronWorker`
(it uses the worker's ``model``, ``arch``, ``hf_path``, ``layout``, ``rollout_shard_plans``,
``cfg`` and offload state)."""
from __future__ import annotations

import torch

from megatron_rl.training.memory_offload import with_training_state
from megatron_rl.training.weights_io import gather_hf_state_dict, local_tensors, local_views


class WeightExport:
    """Collective weight-export methods of a trainer rank."""

    @with_training_state
    def export_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named fp32 state dict of the policy on global rank 0 (None elsewhere);
        includes ``lm_head.weight`` even when tied (vLLM's CPU reload needs it). Collective."""
        return gather_hf_state_dict(local_tensors(self.model), self.arch, include_tied_lm_head=True)

    @with_training_state
    def write_rollout_shards(self, rollout_tp: int, directory: str, version: int, dtype: str) -> dict[str, float]:
        """The policy as vLLM TP ``rollout_tp`` rank files in ``directory`` (sharded_state format),
        moved shard to shard by the resharder (``resharding.rollout_shards``); returns this rank's
        bytes sent/received/copied and seconds. Collective."""
        from megatron_rl.resharding import MegatronLayout, TorchDistributedTransport
        from megatron_rl.resharding.rollout_shards import plan_rollout_shards, stats_dict, write_rollout_shards

        transport, torch_dtype = TorchDistributedTransport(), getattr(torch, dtype)
        # Every sync of a run writes for the same few (TP, dtype): plan once (a collective, and the
        # same call sequence on every rank, so the caches agree).
        plans = self.rollout_shard_plans
        key = (self.arch, rollout_tp, dtype)
        if key not in plans:
            tp, pp = self.layout.tensor_model_parallel_size, self.layout.pipeline_model_parallel_size
            trainer = MegatronLayout(self.arch, tp, pp, torch.distributed.get_world_size() // (tp * pp))
            plans[key] = plan_rollout_shards(self.arch, trainer, rollout_tp, transport, torch_dtype)
        from megatron_rl.quantization.scheme import quant_spec

        stats = write_rollout_shards(local_views(self.model), plans[key], directory, hf_path=self.hf_path,
                                     version=version, transport=transport, dtype=torch_dtype,
                                     quantization=quant_spec(self.cfg.rollout.quantization, dtype))
        return stats_dict(stats)

    @with_training_state
    def export_hf_grads(self) -> dict[str, torch.Tensor] | None:
        """The last mini-batch's gradient (DP-summed, tied embeddings synced), HF-named on rank 0
        (None elsewhere). Raw only when ``optimizer.grad_clip`` is 0: clipping scales it in place.
        For parity checks and debugging. Collective."""
        grads = local_tensors(self.model, pick=lambda p: getattr(p, "main_grad", None))
        return gather_hf_state_dict(grads, self.arch, include_tied_lm_head=False)

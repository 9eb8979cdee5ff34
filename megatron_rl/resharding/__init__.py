"""Resharding Megatron trainer shards (TP_t, PP_t, DP) into vLLM rollout shards (TP_r, replicas).

* ``layouts``: where each HF tensor's rows live in a Megatron or a vLLM layout.
* ``plan``: which slice of which source shard goes to which destination shard, packed into
  size-bounded buckets and scheduled in deadlock-free rounds (pure, identical on every rank).
* ``execute`` + ``transport``: run one process's part of a plan over torch.distributed.
* ``checkpoint_format``: the converter's per-(TP, PP) checkpoint and trainer-checkpoint reading.

Typical use (every process, same arguments)::

    plan = build_plan(MegatronLayout(arch, 2, 2, dp), VLLMLayout(arch, tp_r, engines),
                      trainer_procs, engine_procs, bucket_bytes=256 << 20)
    dests = allocate_destinations(plan, my_rank, torch.bfloat16, "cuda")
    execute_plan(plan, {my_shard: local_tensors}, dests, TorchDistributedTransport(group))
"""
from megatron_rl.resharding.execute import ReshardStats, allocate_destinations, execute_plan
from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout
from megatron_rl.resharding.plan import ReshardPlan, build_plan
from megatron_rl.resharding.transport import TorchDistributedTransport

__all__ = ["MegatronLayout", "VLLMLayout", "ReshardPlan", "build_plan", "ReshardStats", "allocate_destinations",
           "execute_plan", "TorchDistributedTransport"]

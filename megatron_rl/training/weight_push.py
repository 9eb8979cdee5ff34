"""The trainer ranks' side of the tensor weight push (``rollout.weight_sync_format=tensor``): a
mixin of :class:`~megatron_rl.training.megatron_worker.MegatronWorker` around
:class:`~megatron_rl.rollout.weight_sync.push.sender.PushSender`.

Each rank sends only what it holds: the push plan (``resharding.push_plan``) cuts every engine
rank's slice (fused ``qkv_proj`` / ``gate_up_proj``, KV-head replication, vLLM's padded
vocabulary) out of the Megatron shards where they lie, so no rank gathers anything and no rank
holds more than its own shards plus its ring of buckets. The calls, all collective in the sense
that every rank gets them (PolicyGroup calls every rank):

* :meth:`open_weight_push` (the spec from the driver): plan, ring; rank 0 picks the push group's
  port; returns what the engines need to find this rank;
* :meth:`join_weight_push`: enter the push group (at the same time as the engines' workers);
* :meth:`push_weights`: one sync, from the model's current parameters;
* :meth:`close_weight_push`: ring and group gone (also on :meth:`shutdown_weight_pushes`).
"""
from __future__ import annotations

import torch

from megatron_rl.resharding.push_plan import build_push_plan
from megatron_rl.rollout.weight_sync.push.protocol import PushSpec
from megatron_rl.rollout.weight_sync.push.sender import PushSender
from megatron_rl.runtime.fault_injection import fault_point
from megatron_rl.training.memory_offload import with_weights
from megatron_rl.training.weights_io import local_views


class WeightPush:
    """Tensor weight push methods of a trainer rank (uses ``arch``, ``layout``, ``model``)."""

    _pushes: dict[str, PushSender]

    def _push_senders(self) -> dict[str, PushSender]:
        if not hasattr(self, "_pushes"):
            self._pushes = {}
        return self._pushes

    def _trainer_layout(self) -> tuple[int, int, int]:
        tp, pp = self.layout.tensor_model_parallel_size, self.layout.pipeline_model_parallel_size
        return tp, pp, torch.distributed.get_world_size() // (tp * pp)

    def open_weight_push(self, spec: dict) -> dict:
        """Set up push ``spec['key']`` on this rank (replacing one of the same key); returns
        ``path`` (ring file), ``ipc_handle``, ``port`` (rank 0) and the plan ``fingerprint``."""
        push = PushSpec.from_dict(spec)
        if tuple(push.trainer) != self._trainer_layout():
            raise ValueError(f"weight push {push.key}: planned for trainer (TP, PP, DP) {push.trainer}, this run has "
                             f"{self._trainer_layout()}")
        self.close_weight_push(push.key)
        dtype = getattr(torch, push.dtype)
        plan = build_push_plan(self.arch, *push.trainer, push.rollout_tp, push.bucket_bytes,
                               torch.empty((), dtype=dtype).element_size())
        device = torch.device("cuda", torch.cuda.current_device()) if push.device == "cuda" else torch.device("cpu")
        sender = PushSender(push, plan, torch.distributed.get_rank(), device)
        self._push_senders()[push.key] = sender
        return {**sender.describe(), "fingerprint": plan.fingerprint}

    def join_weight_push(self, key: str, port: int, group_ports: list[int] | None = None) -> None:
        """Enter push ``key``'s groups: the one group, whose store trainer rank 0 serves on
        ``port``, or the spec's groups, whose first members serve theirs on ``group_ports``."""
        sender = self._push_senders()[key]
        sender.spec.port = port
        if group_ports is not None:
            sender.spec.group_ports = list(group_ports)
        sender.join()

    @with_weights  # the push reads the weights only: the gradients freed before it stay freed
    def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]:
        """Send this rank's buckets of push ``key`` from the current parameters; returns its figures."""
        try:
            sender = self._push_senders()[key]
        except KeyError:
            raise KeyError(f"weight push {key!r} was not opened on this rank") from None
        fault_point("weight_push.send", step=version, rank=torch.distributed.get_rank())  # tests stall a rank here
        return sender.send(local_views(self.model), sync_id, version)

    def close_weight_push(self, key: str) -> None:
        """Tear push ``key`` down on this rank (no-op when unknown)."""
        sender = self._push_senders().pop(key, None)
        if sender is not None:
            sender.close()

    def shutdown_weight_pushes(self) -> None:
        """Close every push set-up of this rank (rank shutdown)."""
        for key in list(self._push_senders()):
            self.close_weight_push(key)

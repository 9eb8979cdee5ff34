"""The trainer-rank end of the tensor weight push: pack this rank's buckets of the push plan from
its own Megatron shards into bounded slots, hand them to the engines on its node through its ring
and to the others through the push group.

No Megatron here: :class:`PushSender` takes the rank's tensors as a name -> tensor mapping
(``training.weight_push`` gives it the model's local views), so unit tests drive it with plain
tensors. One object per push set-up (engine generation); :meth:`PushSender.send` once per sync.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

from megatron_rl.distributed.ports import free_port
from megatron_rl.resharding.push_plan import PushBucket, PushPlan, pack_bucket
from megatron_rl.rollout.weight_sync.push.channels import NetworkGroup, ShmRing, ticket
from megatron_rl.rollout.weight_sync.push.protocol import (
    LOCAL,
    NET,
    PushSpec,
    group_rank,
    group_size,
    local_replicas,
    ring_path,
)

log = logging.getLogger(__name__)



class PushSender:
    """This trainer rank's side of one push set-up (see the module docstring).

    Args:
        spec: the set-up (same on every rank).
        plan: the push plan for it (``build_push_plan`` with the spec's sizes).
        rank: this trainer rank.
        device: where slots live: 'cpu' (a shared-memory ring) or a CUDA device (CUDA IPC slots).
    """

    def __init__(self, spec: PushSpec, plan: PushPlan, rank: int, device: torch.device | str = "cpu") -> None:
        self.spec, self.plan, self.rank = spec, plan, rank
        self.device = torch.device(device)
        self.dtype = getattr(torch, spec.dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.buckets: list[PushBucket] = plan.for_trainer(rank)
        self.local = local_replicas(spec, rank)
        # Engine TP rank -> group ranks of the workers that get this rank's buckets over the network.
        self.net_targets = {r: [group_rank(spec, e, r) for e in range(spec.num_replicas)
                                if spec.wiring[rank][e] == NET] for r in range(spec.rollout_tp)}
        largest = max((b.numel for b in self.buckets), default=0) * self.itemsize
        self.ring: ShmRing | None = None
        self._ipc_slots: torch.Tensor | None = None
        self.ipc_handle = ""
        if self.local and largest:
            on_gpu = self.device.type == "cuda"
            # On a GPU the header (tickets) stays in host shared memory, the slots on the device.
            self.ring = ShmRing.create(ring_path(spec.key, rank), spec.num_slots, 0 if on_gpu else largest,
                                       len(self.local), spec.rollout_tp)
            if on_gpu:
                from megatron_rl.rollout.weight_sync.push.channels_gpu import export_ipc_slots

                self._ipc_slots, self.ipc_handle = export_ipc_slots(spec.num_slots, largest, self.device)
        self._scratch = (torch.empty(largest // self.itemsize, dtype=self.dtype, device=self.device)
                         if self.ring is None and largest else None)
        self._last = [0] * spec.num_slots
        self.port = free_port("") if rank == 0 and group_size(spec) else 0
        self.group = None

    def describe(self) -> dict:
        """What the driver passes on to the engines (ring path, IPC handle) and, from rank 0, the
        push group's port."""
        return {"path": str(self.ring.path) if self.ring is not None else "", "ipc_handle": self.ipc_handle,
                "port": self.port}

    def join(self) -> None:
        """Enter the push group (when the set-up has one); the engines join at the same time."""
        size = group_size(self.spec)
        if not size or self.group is not None:
            return
        if self.device.type == "cuda":
            from megatron_rl.rollout.weight_sync.push.channels_gpu import NcclGroup

            self.group = NcclGroup(self.spec.host, self.spec.port, self.rank, size, self.device)
        else:
            self.group = NetworkGroup(self.spec.host, self.spec.port, self.rank, size, self.spec.timeout_s)

    def _slot(self, index: int, numel: int) -> torch.Tensor:
        if self._ipc_slots is not None:
            return self._ipc_slots[index].view(self.dtype)[:numel]
        return self.ring.slot(index, self.dtype, numel)

    def _holders(self, slot: int) -> str:
        held = [self.spec.replica_names[e] if self.spec.replica_names else f"engine {e}"
                for i, e in enumerate(self.local) if int(self.ring.done[slot, i]) < self._last[slot]]
        return ", ".join(held) or "nobody"

    def send(self, sources: Mapping[str, torch.Tensor], sync_id: int, version: int) -> dict[str, float]:
        """Pack and hand out every bucket of this rank for push ``sync_id`` (policy ``version``).
        Returns bytes and seconds (``bytes``, ``net_bytes``, ``pack_s``, ``wait_s``, ``net_s``,
        ``seconds``)."""
        start = time.monotonic()
        stats = dict.fromkeys(("bytes", "net_bytes", "pack_s", "wait_s", "net_s"), 0.0)
        if self.buckets and self.group is None and any(self.net_targets.values()):
            raise RuntimeError(f"trainer rank {self.rank}: push group not joined (call join first)")
        n, slots = len(self.buckets), self.spec.num_slots
        for j, bucket in enumerate(self.buckets):
            slot = j % slots
            if self.ring is not None:
                def what(j=j, bucket=bucket, slot=slot) -> str:
                    return (f"weight push v{version} (sync {sync_id}): trainer rank {self.rank}, bucket {j + 1}/{n} "
                            f"for engine TP rank {bucket.dst_rank}: slot {slot} still held by {self._holders(slot)}")

                stats["wait_s"] += self.ring.wait_free(slot, self._last[slot], self.spec.timeout_s, what)
                buf = self._slot(slot, bucket.numel)
            else:
                buf = self._scratch[:bucket.numel]
            t0 = time.monotonic()
            with torch.no_grad():
                pack_bucket(bucket, sources, buf)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()  # the payload is in memory before its ticket
            stats["pack_s"] += time.monotonic() - t0
            stats["bytes"] += bucket.numel * self.itemsize
            if self.ring is not None:
                self._last[slot] = ticket(sync_id, j)
                self.ring.publish(slot, self._last[slot])
            for dst in self.net_targets[bucket.dst_rank]:
                t0 = time.monotonic()
                try:
                    self.group.send(buf, dst)
                except Exception as exc:
                    raise RuntimeError(f"weight push v{version} (sync {sync_id}): trainer rank {self.rank} could not "
                                       f"send bucket {j + 1}/{n} to push-group rank {dst} (engine TP rank "
                                       f"{bucket.dst_rank}): {exc}") from exc
                stats["net_s"] += time.monotonic() - t0
                stats["net_bytes"] += bucket.numel * self.itemsize
        stats["seconds"] = time.monotonic() - start
        return stats

    def close(self) -> None:
        """Leave the group, unmap and remove the ring."""
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self._ipc_slots = self._scratch = None


__all__ = ["PushSender", "LOCAL", "NET"]

"""The trainer-rank end of the tensor weight push: pack this rank's buckets of the push plan from
its own Megatron shards into bounded slots, hand them to the engine workers the spec wires LOCAL
(on its node on CPU, on its GPU on GPU) through its ring and to the others through the push groups.

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
    group_address,
    kind,
    local_replicas,
    net_targets,
    push_groups,
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
        # Engine TP rank -> the ring's consumer slots (local replicas) whose worker of that rank
        # reads this rank's buckets for it; on GPU a replica's workers may differ (one per GPU).
        self.takers = {r: [i for i, e in enumerate(self.local) if kind(spec, rank, e, r) == LOCAL]
                       for r in range(spec.rollout_tp)}
        # Engine TP rank -> (group, group rank) of the workers that get it over the network.
        self.net_targets = net_targets(spec, rank)
        self.my_groups = [(g, members.index(rank)) for g, members in enumerate(push_groups(spec)) if rank in members]
        largest = max((b.numel for b in self.buckets), default=0) * self.itemsize
        unshared = max((b.numel for b in self.buckets if not self.takers[b.dst_rank]), default=0) * self.itemsize
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
        else:
            unshared = largest
        # Buckets no ring consumer reads are packed here and only sent over the network.
        self._scratch = (torch.empty(unshared // self.itemsize, dtype=self.dtype, device=self.device)
                         if unshared else None)
        self._last = [0] * spec.num_slots
        self._slot_takers: list[list[int]] = [[] for _ in range(spec.num_slots)]
        # This rank hosts the store of every group it leads (on CPU: rank 0, the one group).
        self.ports = {g: free_port("") for g, me in self.my_groups if me == 0}
        self.port = next(iter(self.ports.values()), 0)
        self.groups: dict[int, object] = {}

    def describe(self) -> dict:
        """What the driver passes on to the engines (ring path, IPC handle) and the ports of the
        groups this rank leads (``port``: the first one's, the one group's on CPU)."""
        return {"path": str(self.ring.path) if self.ring is not None else "", "ipc_handle": self.ipc_handle,
                "port": self.port, "ports": {str(g): p for g, p in self.ports.items()}}

    @property
    def group(self):
        """The push group (the first one this rank is in), or None before :meth:`join`."""
        return next(iter(self.groups.values()), None)

    def join(self) -> None:
        """Enter this rank's push groups, in group order (every member does, so no two members
        wait for each other in different groups); the engines join at the same time."""
        if self.groups or not self.my_groups:
            return
        addresses = self.group_addresses()
        for g, me in self.my_groups:
            host, port = addresses[g]
            size = len(push_groups(self.spec)[g])
            if self.device.type == "cuda":
                from megatron_rl.rollout.weight_sync.push.channels_gpu import NcclGroup

                self.groups[g] = NcclGroup(host, port, me, size, self.device)
            else:
                self.groups[g] = NetworkGroup(host, port, me, size, self.spec.timeout_s)

    def group_addresses(self) -> dict[int, tuple[str, int]]:
        """(host, port) of the store of every group this rank is in: its own port where it leads
        the group, else the spec's (the driver hands every rank the ports at :meth:`join` time)."""
        out = {}
        for g, _ in self.my_groups:
            host, port = group_address(self.spec, g)
            out[g] = host, self.ports.get(g, port)
            if not out[g][1]:
                raise RuntimeError(f"weight push {self.spec.key}: trainer rank {self.rank} has no port for push group {g}")
        return out

    def _slot(self, index: int, numel: int) -> torch.Tensor:
        if self._ipc_slots is not None:
            return self._ipc_slots[index].view(self.dtype)[:numel]
        return self.ring.slot(index, self.dtype, numel)

    def _holders(self, slot: int) -> str:
        held = [self.spec.replica_names[self.local[i]] if self.spec.replica_names else f"engine {self.local[i]}"
                for i in self._slot_takers[slot] if int(self.ring.done[slot, i]) < self._last[slot]]
        return ", ".join(held) or "nobody"

    def send(self, sources: Mapping[str, torch.Tensor], sync_id: int, version: int) -> dict[str, float]:
        """Pack and hand out every bucket of this rank for push ``sync_id`` (policy ``version``).
        Returns bytes and seconds (``bytes``, ``net_bytes``, ``pack_s``, ``wait_s``, ``net_s``,
        ``seconds``)."""
        start = time.monotonic()
        stats = dict.fromkeys(("bytes", "net_bytes", "pack_s", "wait_s", "net_s"), 0.0)
        if self.buckets and not self.groups and any(self.net_targets.values()):
            raise RuntimeError(f"trainer rank {self.rank}: push group not joined (call join first)")
        n, slots = len(self.buckets), self.spec.num_slots
        for j, bucket in enumerate(self.buckets):
            slot = j % slots
            takers = self.takers[bucket.dst_rank] if self.ring is not None else []
            if takers:
                def what(j=j, bucket=bucket, slot=slot) -> str:
                    return (f"weight push v{version} (sync {sync_id}): trainer rank {self.rank}, bucket {j + 1}/{n} "
                            f"for engine TP rank {bucket.dst_rank}: slot {slot} still held by {self._holders(slot)}")

                stats["wait_s"] += self.ring.wait_free(slot, self._last[slot], self.spec.timeout_s, what,
                                                       self._slot_takers[slot])
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
            if takers:
                self._last[slot], self._slot_takers[slot] = ticket(sync_id, j), takers
                self.ring.publish(slot, self._last[slot])
            for g, dst in self.net_targets[bucket.dst_rank]:
                t0 = time.monotonic()
                try:
                    self.groups[g].send(buf, dst)
                except Exception as exc:
                    raise RuntimeError(f"weight push v{version} (sync {sync_id}): trainer rank {self.rank} could not "
                                       f"send bucket {j + 1}/{n} to rank {dst} of push group {g} (engine TP rank "
                                       f"{bucket.dst_rank}): {exc}") from exc
                stats["net_s"] += time.monotonic() - t0
                stats["net_bytes"] += bucket.numel * self.itemsize
        stats["seconds"] = time.monotonic() - start
        return stats

    def close(self) -> None:
        """Leave the group, unmap and remove the ring."""
        for group in self.groups.values():
            group.close()
        self.groups = {}
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self._ipc_slots = self._scratch = None


__all__ = ["PushSender", "LOCAL", "NET"]

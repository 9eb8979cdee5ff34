"""Trainer ranks for tensor-push tests without Megatron: each "rank" is a thread of this process
holding its Megatron shards, cut from an HF checkpoint by the trainer's own HF -> Megatron
conversion, behind the ``weight_sync.push.transport.PushWriter`` protocol that ``PolicyGroup`` implements."""
from __future__ import annotations

import asyncio
import socket

import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import read_qwen2_arch
from megatron_rl.resharding.layouts import MegatronLayout
from megatron_rl.resharding.push_plan import build_push_plan
from megatron_rl.rollout.weight_sync.push.protocol import PushSpec
from megatron_rl.rollout.weight_sync.push.sender import PushSender
from megatron_rl.training.weights_io import LazySafetensors


def megatron_shards(model_dir, tp: int, pp: int = 1, dp: int = 1) -> list[dict[str, torch.Tensor]]:
    """Every trainer rank's Megatron tensors (local-spec names) of the HF checkpoint."""
    arch, hf = read_qwen2_arch(model_dir), LazySafetensors(model_dir)
    layout = MegatronLayout(arch, tp, pp, dp)
    out = []
    for rank in range(layout.num_shards):
        tp_rank, pp_rank, _ = layout.coords(rank)
        out.append(hf_to_megatron_shard(hf, arch, tp_rank, tp, pp_rank, pp))
    return out


class ThreadTrainer:
    """``PushWriter`` over threads; ``model_dir`` is what the next push sends (set it to change
    the weights). ``nodes`` overrides the ranks' node names (default: this host, which is what an
    engine outside Ray reports); ``hold`` makes a rank skip its sends (a stalled trainer rank)."""

    def __init__(self, model_dir, tp: int = 2, nodes: list[str] | None = None) -> None:
        self.model_dir, self.tp = model_dir, tp
        self.nodes = nodes or [socket.gethostname()] * tp
        self.senders: dict[str, list[PushSender]] = {}
        self.hold: set[int] = set()
        self.calls: list[str] = []

    async def rank_nodes(self) -> list[tuple[str, str]]:
        return [(n, "127.0.0.1") for n in self.nodes]

    async def open_weight_push(self, spec: dict) -> list[dict]:
        push = PushSpec.from_dict(spec)
        plan = build_push_plan(read_qwen2_arch(self.model_dir), *push.trainer, push.rollout_tp, push.bucket_bytes, 4)
        self.senders[push.key] = [PushSender(PushSpec.from_dict(spec), plan, r) for r in range(self.tp)]
        self.calls.append(f"open({push.key})")
        return [{**s.describe(), "fingerprint": plan.fingerprint} for s in self.senders[push.key]]

    async def join_weight_push(self, key: str, port: int) -> None:
        self.calls.append(f"join({key})")

        def join(sender):
            sender.spec.port = port
            sender.join()

        await asyncio.gather(*(asyncio.to_thread(join, s) for s in self.senders[key]))

    async def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]:
        self.calls.append(f"push({key},{sync_id},v{version})")
        shards = megatron_shards(self.model_dir, self.tp)
        senders = self.senders[key]
        per_rank = await asyncio.gather(*(asyncio.to_thread(s.send, shards[r], sync_id, version)
                                          for r, s in enumerate(senders) if r not in self.hold))
        total = {k: sum(r[k] for r in per_rank) for k in ("bytes", "net_bytes")}
        total.update({k: max(r[k] for r in per_rank) for k in ("pack_s", "wait_s", "net_s", "seconds")})
        return total

    async def close_weight_push(self, key: str) -> None:
        self.calls.append(f"close({key})")
        for s in self.senders.pop(key, []):
            s.close()

    def close(self) -> None:
        for key in list(self.senders):
            for s in self.senders.pop(key):
                s.close()


class SenderRank:
    """Ray actor body: one trainer rank of :class:`RayTrainer` (its shards cut from ``model_dir``)."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank, self.tp = rank, tp
        self.senders: dict[str, PushSender] = {}

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def open(self, spec: dict, model_dir: str) -> dict:
        push = PushSpec.from_dict(spec)
        plan = build_push_plan(read_qwen2_arch(model_dir), *push.trainer, push.rollout_tp, push.bucket_bytes, 4)
        self.senders[push.key] = PushSender(push, plan, self.rank)
        return {**self.senders[push.key].describe(), "fingerprint": plan.fingerprint}

    def join(self, key: str, port: int) -> None:
        sender = self.senders[key]
        sender.spec.port = port
        sender.join()

    def send(self, key: str, sync_id: int, version: int, model_dir: str) -> dict:
        return self.senders[key].send(megatron_shards(model_dir, self.tp)[self.rank], sync_id, version)

    def close(self, key: str) -> None:
        sender = self.senders.pop(key, None)
        if sender is not None:
            sender.close()


class RayTrainer:
    """``PushWriter`` over :class:`SenderRank` actors (``actor_options`` place them)."""

    def __init__(self, model_dir, tp: int = 2, actor_options: dict | None = None) -> None:
        import ray

        self.model_dir = str(model_dir)
        options = {"num_cpus": 0, **(actor_options or {})}
        self.ranks = [ray.remote(SenderRank).options(**options).remote(r, tp) for r in range(tp)]

    async def rank_nodes(self) -> list[tuple[str, str]]:
        return [tuple(n) for n in await asyncio.gather(*(r.node.remote() for r in self.ranks))]

    async def open_weight_push(self, spec: dict) -> list[dict]:
        return list(await asyncio.gather(*(r.open.remote(spec, self.model_dir) for r in self.ranks)))

    async def join_weight_push(self, key: str, port: int) -> None:
        await asyncio.gather(*(r.join.remote(key, port) for r in self.ranks))

    async def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]:
        per_rank = await asyncio.gather(*(r.send.remote(key, sync_id, version, self.model_dir) for r in self.ranks))
        total = {k: sum(r[k] for r in per_rank) for k in ("bytes", "net_bytes")}
        total.update({k: max(r[k] for r in per_rank) for k in ("pack_s", "wait_s", "net_s", "seconds")})
        return total

    async def close_weight_push(self, key: str) -> None:
        await asyncio.gather(*(r.close.remote(key) for r in self.ranks))

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)

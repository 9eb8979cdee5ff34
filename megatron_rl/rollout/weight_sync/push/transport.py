"""``rollout.weight_sync_format=tensor``: weights go from the trainer ranks' memory straight into
the engines' parameters through vLLM's weight-transfer API, no files and no fan-out.

The driver side of the push (the trainer ranks' side is ``training.weight_push``, the engine
workers' ``rollout.worker.push_receiver``). For a set of engines (their replicas' ids, nodes and, on GPU, their
workers' GPU UUIDs, from ``RolloutEngine.weight_receivers``; the trainer ranks' from
``rank_nodes`` / ``rank_gpus``) it sets a push up once: a
:class:`~megatron_rl.rollout.weight_sync.push.protocol.PushSpec` wires each (trainer rank, engine
worker) pair locally (shared memory on one node on CPU, CUDA IPC on one GPU) or through a push
group (gloo / NCCL), as ``push.topology`` decides, the trainer ranks open their rings, the engines
run ``init_weight_transfer_engine``. It sets up again when the engines change
(an elastic-TP switch). Each sync then runs the trainer ranks' send and the engines'
``start_weight_update / update_weights / finish_weight_update(version)`` at the same time.

Failures: both sides bound every wait by ``rollout.weight_push_timeout_s`` and name who they
waited for; the driver waits at most that long (plus a margin) for both, reports both sides'
errors, and drops the set-up. An engine whose push failed refuses requests (its weights are half
new), so nothing is generated from them; the run fails with the error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from megatron_rl.distributed.errors import one_line
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.weight_sync.interface import WeightTransport
from megatron_rl.rollout.weight_sync.push.protocol import PushSpec, engine_init_info, group_size, push_groups
from megatron_rl.rollout.weight_sync.push.start_dir import write_push_start_dir
from megatron_rl.rollout.weight_sync.push.topology import Place, pair
from megatron_rl.runtime.aio import wait_for

log = logging.getLogger(__name__)

_GRACE_S = 10.0
"""After one side of a push failed, how long the other gets to report its own error."""
_MARGIN_S = 30.0
"""The driver's wait for a push (or a set-up) beyond the sides' own timeout: RPC latency."""
_HEALTH_EVERY_S = 1.0
"""While a push runs, how often the engines' health is checked (a dead engine may never answer)."""


class PushWriter(Protocol):
    """The trainer ranks as the tensor push sees them (``PolicyGroup`` implements it)."""

    async def rank_nodes(self) -> list[tuple[str, str]]: ...
    async def rank_gpus(self) -> list[str]: ...  # only asked on GPU
    async def open_weight_push(self, spec: dict) -> list[dict]: ...
    async def join_weight_push(self, key: str, port: int, group_ports: list[int] | None = None) -> None: ...
    async def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]: ...
    async def close_weight_push(self, key: str) -> None: ...


@dataclass(frozen=True)
class PushOptions:
    """What the run fixes about its pushes (``rollout.weight_push_*``)."""

    trainer: tuple[int, int, int]
    """Trainer (TP, PP, DP)."""
    hf_path: str
    """The model's HF directory (config and tokenizer for engines started without weights)."""
    bucket_bytes: int = 64 << 20
    num_slots: int = 2
    timeout_s: float = 120.0
    device: str = "cpu"
    network_only: bool = False
    quantization: str = "none"
    """rollout.quantization: engines started for a push are quantized engines (their config
    says so); the engines quantize what they receive (``rollout.worker.push_receiver``)."""


def replica_places(receiver: tuple, tp: int) -> list[Place]:
    """Where each TP rank of a replica runs: ``weight_receivers`` gives (id, node) and, from
    engines on GPUs, a third item, the GPU UUID of each TP rank."""
    gpus = list(receiver[2]) if len(receiver) > 2 else []
    if gpus and len(gpus) != tp:
        raise ValueError(f"engine replica {receiver[0]}: {len(gpus)} GPU UUIDs reported for TP {tp}")
    return [Place(receiver[1], gpus[r] if gpus else "") for r in range(tp)]


class WeightPushError(RuntimeError):
    """A push failed; the message names the engine, rank and policy version."""


@dataclass
class _SetUp:
    key: str
    ids: list[str]
    spec: PushSpec


class TensorTransport(WeightTransport):
    """The tensor weight push (see the module docstring)."""

    name = "tensor"
    streams_from_trainer = True
    writes_directory = False
    starts_engines_empty = True

    @classmethod
    def for_run(cls, writer, directory: str, dtype: str, cfg, on_gpu: bool) -> "TensorTransport":
        p, r = cfg.parallel, cfg.rollout
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        # CP ranks hold the same weights as DP replicas do: the push plan folds CP into DP.
        dp = p.data_parallel_size * p.context_parallel_size
        options = PushOptions(trainer=(tp, pp, dp), hf_path=cfg.model.hf_path,
                              bucket_bytes=int(r.weight_push_bucket_mb * (1 << 20)), num_slots=r.weight_push_buffers,
                              timeout_s=r.weight_push_timeout_s, device="cuda" if on_gpu else "cpu",
                              network_only=r.weight_push_channel == "network", quantization=r.quantization)
        return cls(writer, directory, dtype, options)

    def __init__(self, writer: PushWriter, directory: str, dtype: str, options: PushOptions) -> None:
        super().__init__(writer, directory, dtype)
        self.options = options
        self._setup: _SetUp | None = None
        self._sync_id = 0
        self._setups = 0
        self._nodes: list[tuple[str, str]] | None = None
        self._gpus: list[str] = []

    async def stage(self, version: int, tp: int) -> dict[str, float]:
        return {}  # nothing leaves the trainer before the engines are awake to take it

    async def new_engine_dir(self, tp: int, version: int) -> str:
        """New engines start from config and tokenizer only (dummy weights), then get a push."""
        from megatron_rl.quantization.scheme import quant_spec

        spec = quant_spec(self.options.quantization, self.dtype)
        return str(write_push_start_dir(self.options.hf_path, self.directory, tp, version, quantization=spec))

    async def load(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        figures = await self._ensure_setup(engine)
        self._sync_id += 1
        figures.update(await self._push(engine, version, self._sync_id))
        return figures

    # ------------------------------------------------------------------ set-up
    async def _ensure_setup(self, engine: RolloutEngine) -> dict[str, float]:
        receivers = await engine.weight_receivers()
        ids = [r[0] for r in receivers]
        if self._setup is not None and self._setup.ids == ids:
            return {}
        start = time.monotonic()
        await self.close()
        o = self.options
        if self._nodes is None:
            self._nodes = await self.writer.rank_nodes()
            if o.device == "cuda":
                self._gpus = list(await self.writer.rank_gpus())
        self._setups += 1
        tp = engine.tensor_parallel_size
        trainer = [Place(node, self._gpus[t] if self._gpus else "") for t, (node, _) in enumerate(self._nodes)]
        wires, groups = pair(trainer, [replica_places(r, tp) for r in receivers], o.device, o.network_only)
        spec = PushSpec(key=f"push{self._setups}", trainer=o.trainer, rollout_tp=tp, dtype=self.dtype,
                        bucket_bytes=o.bucket_bytes, num_slots=o.num_slots, timeout_s=o.timeout_s, device=o.device,
                        wiring=wires, host=self._nodes[0][1], groups=groups,
                        group_hosts=[self._nodes[g[0]][1] for g in groups],
                        replica_names=[f"engine {e} (TP{tp}, node {r[1][:8]}, {r[0]})"
                                       for e, r in enumerate(receivers)])
        ranks = await self.writer.open_weight_push(spec.to_dict())
        fingerprints = {r["fingerprint"] for r in ranks}
        if len(fingerprints) != 1:
            raise WeightPushError(f"weight push {spec.key}: trainer ranks built different plans {sorted(fingerprints)}")
        spec.port = int(ranks[0]["port"])
        # Each group's store is on its first member, a trainer rank, which picked the port.
        spec.group_ports = [int(ranks[g[0]]["ports"][str(i)]) for i, g in enumerate(spec.groups)]
        fingerprint = fingerprints.pop()
        infos = [engine_init_info(spec, e, ranks, fingerprint) for e in range(len(receivers))]
        steps = [engine.open_weight_receiver(infos)]
        if group_size(spec):
            # Both ends rendezvous together; a rank in a group it does not lead needs that group's port.
            extra = (spec.group_ports,) if spec.groups else ()
            steps.append(self.writer.join_weight_push(spec.key, spec.port, *extra))
        try:
            await wait_for(asyncio.gather(*steps), timeout=o.timeout_s + _MARGIN_S)
        except BaseException as exc:
            await self._close_trainer_side(spec.key)
            raise WeightPushError(f"weight push set-up {spec.key} for {len(receivers)} engine(s) of TP {tp} "
                                  f"failed: {exc!r}") from exc
        self._setup = _SetUp(spec.key, ids, spec)
        log.info("weight push %s set up: %d trainer ranks -> %d engine(s) of TP %d (%d push group(s)); rings %s",
                 spec.key, spec.num_trainer_ranks, len(receivers), tp, len(push_groups(spec)),
                 " ".join(r["path"] for r in ranks if r["path"]) or "none")
        return {"push_setup_s": time.monotonic() - start}

    async def _close_trainer_side(self, key: str) -> None:
        try:
            # Bounded: after a failed push a rank may be stalled or dead and never answer.
            await wait_for(self.writer.close_weight_push(key), timeout=_GRACE_S)
        except Exception as exc:  # teardown must not hide the real error
            log.warning("closing weight push %s on the trainer ranks failed: %r", key, exc)

    async def close(self) -> None:
        """Drop the current set-up on the trainer ranks (the engines it was for are gone or will
        be set up again)."""
        if self._setup is not None:
            key, self._setup = self._setup.key, None
            await self._close_trainer_side(key)

    # ------------------------------------------------------------------ one sync
    async def _push(self, engine: RolloutEngine, version: int, sync_id: int) -> dict[str, float]:
        setup = self._setup
        start = time.monotonic()
        send = asyncio.ensure_future(self.writer.push_weights(setup.key, sync_id, version))
        recv = asyncio.ensure_future(engine.receive_weights(sync_id, version))
        limit = self.options.timeout_s + _MARGIN_S
        pending, failed, dead = await self._wait_for_sides(engine, send, recv, limit)
        if pending and (failed or dead):  # let the other side say what it saw
            _, pending = await asyncio.wait(pending, timeout=_GRACE_S)
        if failed or pending or dead:
            for task in pending:
                task.cancel()
            self._setup = None
            if send in pending:  # a rank still in the push (stalled) would not get to the close before it ends
                log.warning("weight push %s: trainer ranks still sending; its set-up is left to their teardown",
                            setup.key)
            else:
                await self._close_trainer_side(setup.key)
            raise WeightPushError(self._failure(setup, version, send, recv, limit, dead))
        sent, received = send.result(), recv.result()
        seconds = time.monotonic() - start
        # Transport: until the slowest replica holds every byte (the RPC start included); load:
        # busy time of vLLM's loaders, which overlaps the transport (so the two need not add up).
        load_s = max(r["load_s"] for r in received)
        tail = max(r["seconds"] - r.get("transport_s", r["seconds"] - r["load_s"]) for r in received)
        return {"push_mb": max(r["bytes"] for r in received) / 1e6, "push_replicas": float(len(received)),
                "push_s": seconds, "push_load_s": load_s, "push_transport_s": seconds - tail,
                "push_pack_s": sent["pack_s"], "push_wait_s": sent["wait_s"], "push_net_mb": sent["net_bytes"] / 1e6,
                **{f"push_engine_{k}": max(r.get(k, 0.0) for r in received) for k in ("copy_s", "wait_s", "worker_s")}}

    @staticmethod
    async def _wait_for_sides(engine: RolloutEngine, send: asyncio.Future, recv: asyncio.Future,
                              limit: float) -> tuple[set, list, BaseException | None]:
        """Wait up to ``limit`` for both sides, until one fails, or until the engines fail a
        health check: an engine that died mid-push may never answer its receive call (vLLM does
        not fail a utility call whose engine core is gone). Returns (pending, failed, the health
        check's error)."""
        deadline = time.monotonic() + limit
        pending: set = {send, recv}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return pending, [], None
            done, pending = await asyncio.wait(pending, timeout=min(left, _HEALTH_EVERY_S),
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if failed:
                return pending, failed, None
            if recv in pending:
                try:
                    await wait_for(engine.check_health(), timeout=_GRACE_S)
                except Exception as exc:
                    return pending, [], exc
        return pending, [], None

    @staticmethod
    def _failure(setup: _SetUp, version: int, send: asyncio.Future, recv: asyncio.Future, limit: float,
                 dead: BaseException | None = None) -> str:
        def side(task: asyncio.Future) -> str:
            if task is recv and dead is not None and (not task.done() or task.cancelled()):
                return f"failed their health check during the push ({one_line(dead)})"
            if not task.done() or task.cancelled():
                return f"no answer within {limit:.0f} s"
            exc = task.exception()
            return "ok" if exc is None else one_line(exc)

        return (f"weight push of policy version {version} ({setup.key}) into {', '.join(setup.spec.replica_names)} "
                f"failed. Engines: {side(recv)}. Trainer ranks: {side(send)}. Engines that took part refuse "
                "requests until a push completes.")

"""The Ray actor body of a rollout engine: one VLLMEngine in the actor's process plus the
completion buffer its driver-side client (``ray_engine.RayEngineClient``) long-polls, and the
split of the engine contract across the actor boundary that both sides forward by.

``ray.remote`` wraps :class:`EngineActor` on the driver (``RayEngineClient.create``); this module
imports neither Ray nor the driver's wrappers.
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import (
    ENGINE_CONTRACT,
    SINGLE_ENGINE_DEFAULTS,
    Completion,
    GenerationRequest,
    RolloutEngine,
    forward_completions,
)
from megatron_rl.rollout.engine_wrapper import forwards
from megatron_rl.runtime.aio import wait_for
from megatron_rl.runtime.fault_injection import fault_point

ANSWERED_BY_THE_CLIENT: dict[str, str] = {
    "completions": "a stream cannot be returned by an actor call: the client long-polls EngineActor.drain",
    "tensor_parallel_size": "known from the config the actor was created with: no round trip",
    **{name: "an actor hosts one engine: the contract's single-engine default" for name in SINGLE_ENGINE_DEFAULTS},
}
"""The contract members the driver-side client answers itself, and why; every other member is one
actor call of the same name (:data:`REMOTE_MEMBERS`)."""

REMOTE_MEMBERS: tuple[str, ...] = tuple(name for name in ENGINE_CONTRACT if name not in ANSWERED_BY_THE_CLIENT)
"""Contract members that cross the actor boundary: forwarded by ``ray_engine.RayEngineClient`` as actor
calls and by :class:`EngineActor` to its VLLMEngine (each side overrides only what it adds:
the actor's pump, segment records and fault point; the client's health timeout and teardown)."""


@forwards(REMOTE_MEMBERS)
class EngineActor:
    """Ray actor body: one VLLMEngine plus a completion buffer drained by the client.

    Wrapped with ``ray.remote`` in ``ray_engine.RayEngineClient.create``; all methods are coroutines so
    the actor is an async actor and calls overlap (submit while a drain is waiting). The members
    of :data:`REMOTE_MEMBERS` not defined here are forwarded to the engine as they are.
    """

    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, max_model_len: int) -> None:
        from megatron_rl.rollout.actor.vllm_engine import VLLMEngine

        self._engine = VLLMEngine(model_path, cfg, seed, max_model_len)
        self._segments: set[str] = set()
        """``psm_*`` segments this actor's engine processes mapped (removed after a death)."""
        self._buffer: list[Completion | Exception] = []
        self._ready = asyncio.Event()
        self._pump: asyncio.Task | None = None

    async def _forward_target(self) -> RolloutEngine:
        return self._engine

    def _ensure_pump(self) -> None:
        # Started lazily: the actor's event loop is running only once a method executes.
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._pump_completions())

    async def _pump_completions(self) -> None:
        # The engine's failure goes into the buffer too: the client's drain() raises it.
        await forward_completions(self._engine, self._buffered, self._buffered)

    def _buffered(self, item: Completion | Exception) -> None:
        self._buffer.append(item)
        self._ready.set()

    async def ready(self) -> bool:
        """Returns once the actor (and its engine) is constructed."""
        self._ensure_pump()
        self._record_segments()
        return True

    def process_ids(self) -> dict[str, Any]:
        """This actor's pid and its engine's processes (vLLM's engine core and any workers), for
        health reports and fault-injection tests."""
        import psutil

        return {"actor": os.getpid(), "node": socket.gethostname(),
                "engine": [p.pid for p in psutil.Process().children(recursive=True)]}

    def _record_segments(self) -> None:
        from megatron_rl.distributed.local_state import mapped_segments

        self._segments |= mapped_segments([os.getpid(), *self.process_ids()["engine"]])

    async def check_health(self) -> None:
        """Forward to VLLMEngine.check_health (raises once the engine core died)."""
        await self._engine.check_health()
        self._record_segments()  # segments of workers started late (TP > 1) are caught too

    def shm_segments(self) -> list[str]:
        """The ``psm_*`` segments this actor's engine processes were seen to map."""
        return sorted(self._segments)

    async def submit(self, request: GenerationRequest) -> None:
        """Forward to VLLMEngine.submit."""
        self._ensure_pump()
        await self._engine.submit(request)
        # Fault-injection tests kill the engine here, holding a request (inert unless armed).
        fault_point("engine.submit", step=self._engine.weight_version, part=lambda: self.process_ids()["engine"])

    async def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Forward to VLLMEngine.submit_all (one actor call for a whole launch)."""
        self._ensure_pump()
        await self._engine.submit_all(requests)
        fault_point("engine.submit", step=self._engine.weight_version, part=lambda: self.process_ids()["engine"])

    async def sleep(self, level: int = 1) -> None:
        """Forward to VLLMEngine.sleep."""
        await self._engine.sleep(level)
        # Fault-injection tests kill the engine here: a pool member lent to the stream trainer dies
        # asleep, found only when the pool wakes it (inert unless armed).
        fault_point("engine.sleep", step=self._engine.weight_version, part=lambda: self.process_ids()["engine"])

    async def drain(self, max_wait_s: float) -> list[Completion]:
        """All completions buffered so far, waiting up to ``max_wait_s`` for the first one."""
        self._ensure_pump()
        if not self._buffer:
            try:
                await wait_for(self._ready.wait(), timeout=max_wait_s)
            except asyncio.TimeoutError:
                return []
        batch, self._buffer = self._buffer, []
        self._ready.clear()
        for item in batch:
            if isinstance(item, Exception):
                raise item
        return batch

    async def shutdown(self) -> None:
        """Stop the engine's processes and remove the shared memory a dead one left behind."""
        from megatron_rl.distributed.local_state import remove_unmapped_segments

        try:
            await self._engine.shutdown()
            if self._pump is not None:
                await asyncio.wait([self._pump], timeout=5.0)
        finally:
            remove_unmapped_segments(self._segments)

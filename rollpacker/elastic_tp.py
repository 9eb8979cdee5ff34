"""The elastic-TP planner wired to real engines: one TP per round type, switched between rounds.

A trainer plug-in: before each round (``before_rollout``, with the round type the scheduler will
run next), when the planner wants another TP for that type, the engines are rebuilt at it
(:class:`megatron_rl.rollout.driver.elastic.ElasticRollout`) and loaded with the current weights. After
the round ``after_rollout`` feeds the round's preemption count to the planner's online
rule (preemptions up > growth -> double TP; quiet rounds -> halve TP). The planner's state is
training state and goes into the checkpoint.

How weights reach engines of the new TP: the old engines are shut down, then with the tensor
weight sync (``rollout.weight_sync_format=tensor``, the default) the new engines start from the
model's config and tokenizer only, with dummy weights, refusing requests, and get a tensor push
of the current policy version right after they are up (``WeightSync.write_for_new_engines`` /
``load_new_engines``): no model copy on disk. With the file formats the trainer ranks move their
Megatron shards straight into vLLM's TP layout for the new size with the resharding executor
(``megatron_rl.resharding``: point to point, size-bounded buckets, every byte once) and write one
file per engine rank (vLLM's ``sharded_state`` format) into the weight-sync directory (with the
trainer made resident for it when offloaded); the new engines start from it, each rank loading
only its own file, tagged with the current policy version.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import LoopServices, RolloutBatch, TrainerPlugin
from megatron_rl.rollout.driver.elastic import ElasticRollout
from rollpacker.planner import ElasticTPPlanner

log = logging.getLogger(__name__)


class ElasticTP(TrainerPlugin):
    """Trainer plug-in: planner + elastic engines, switched before each round (module docstring)."""

    name = "planner"
    """Checkpoint key: the planner's state is saved under ``plugins.planner`` of the driver state."""

    def __init__(self, cfg: RunConfig, planner: ElasticTPPlanner, rollout: ElasticRollout,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.planner = planner
        self.rollout = rollout
        self.clock = clock
        self.loop: LoopServices | None = None
        self._preemptions_at_start = 0
        self._switch_metrics: dict[str, float] = {}
        self._switch_s = 0.0

    def attach(self, loop: LoopServices) -> None:
        self.loop = loop

    async def before_rollout(self, step: int, round_type: str) -> dict[str, float]:
        """Rebuild the engines when the planner wants another TP for ``round_type``, from the rank
        files the weight sync writes for it (see the module docstring)."""
        start = self.clock()
        tp = self.planner.tp_for(round_type)
        self._switch_metrics = {}
        if tp != self.rollout.tp:
            async def write(new_tp: int) -> tuple[str, dict[str, float]]:
                return await self.loop.weight_sync.write_for_new_engines(new_tp, self.loop.version)

            async def load(engines) -> dict[str, float]:
                return await self.loop.weight_sync.load_new_engines(engines, self.loop.version)

            self._switch_metrics = await self.rollout.switch(tp, write, load)
        self._preemptions_at_start = (await self.rollout.stats()).preemptions
        self._switch_s = self.clock() - start
        return {}

    async def after_rollout(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """Feed the round's preemptions to the online rule; metrics under planner/*."""
        preemptions = (await self.rollout.stats()).preemptions - self._preemptions_at_start
        decision = self.planner.observe(batch.round_type, preemptions)
        if decision.changed:
            log.info("planner: %s rounds go from TP %d to TP %d (%s, %d preemptions)", batch.round_type,
                     decision.old_tp, decision.new_tp, decision.reason, preemptions)
        m = {
            "time/engine_switch": self._switch_s,
            "planner/rollout_tp": float(self.rollout.tp),
            "planner/preemptions": float(preemptions),
            "planner/next_tp": float(decision.new_tp),
            "planner/switched": float(bool(self._switch_metrics)),
        }
        for key in ("switch_s", "reshard_mb", "reshard_s", "reshard_rounds", "fanout_mb", "fanout_nodes", "fanout_s",
                    "push_mb", "push_s", "push_setup_s"):
            if key in self._switch_metrics:
                m[f"planner/{key}"] = self._switch_metrics[key]
        return m

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)


def build_elastic_tp(cfg: RunConfig, engine, factory, on_gpu: bool) -> ElasticTP:
    """The planner for ``cfg.planner`` over the rollout devices, wrapping ``engine`` (built at
    rollout.tensor_parallel_size) so ``factory(tp)`` can rebuild it. Returns the hook; its
    ``rollout`` is the engine the loop must use."""
    from megatron_rl.model.arch import read_qwen2_arch
    from rollpacker.config import PlannerConfig
    from rollpacker.planner import legal_tp_sizes, planner_for_run

    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    per_node = cfg.cluster.gpus_per_node if on_gpu else devices
    sizes = legal_tp_sizes(read_qwen2_arch(cfg.model.hf_path), per_node, devices, cfg.section(PlannerConfig).max_tp)
    planner = planner_for_run(cfg, sizes)
    return ElasticTP(cfg, planner, ElasticRollout(engine, cfg.rollout.tensor_parallel_size, factory))

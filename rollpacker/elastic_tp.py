"""The elastic-TP planner wired to real engines: one TP per round type, switched between rounds.

Before each round the loop asks :meth:`ElasticTP.before_round` with the round type the scheduler
will run next; when the planner wants another TP for that type, the engines are rebuilt at it
(:class:`megatron_rl.rollout.elastic.ElasticRollout`) and loaded with the current weights. After
the round :meth:`ElasticTP.after_round` feeds the round's preemption count to the planner's online
rule (preemptions up > growth -> double TP; quiet rounds -> halve TP). The planner's state is
training state and goes into the checkpoint.

How weights reach engines of the new TP: the old engines are shut down, the trainer ranks move
their Megatron shards straight into vLLM's TP layout for the new size with the resharding
executor (``megatron_rl.resharding``: point to point, size-bounded buckets, every byte once) and
write one file per engine rank (vLLM's ``sharded_state`` format) into the weight-sync directory;
the new engines start from it, each rank loading only its own file, tagged with the current
policy version. Later syncs of those engines go through the same directory
(``rollout.weight_sync_format``).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from megatron_rl.config import RunConfig
from megatron_rl.rollout.elastic import ElasticRollout
from rollpacker.planner import ElasticTPPlanner

log = logging.getLogger(__name__)

ShardWriter = Callable[[int], Awaitable[tuple[str, dict[str, float]]]]
"""``write_shards(tp)``: the trainer writes its weights as rollout shards for TP ``tp`` (in the
engines' dtype); returns the directory and the resharder's figures (bytes_sent, bytes_local,
seconds, rounds)."""


class ElasticTP:
    """Planner + elastic engines; called by the trainer around each round."""

    def __init__(self, cfg: RunConfig, planner: ElasticTPPlanner, rollout: ElasticRollout) -> None:
        self.cfg = cfg
        self.planner = planner
        self.rollout = rollout
        self._preemptions_at_start = 0
        self._switch_metrics: dict[str, float] = {}

    async def before_round(self, round_type: str, write_shards: ShardWriter) -> None:
        """Rebuild the engines when the planner wants another TP for ``round_type``, from the
        shards ``write_shards(tp)`` writes (see the module docstring)."""
        tp = self.planner.tp_for(round_type)
        self._switch_metrics = {}
        if tp != self.rollout.tp:
            async def write(new_tp: int) -> tuple[str, dict[str, float]]:
                directory, stats = await write_shards(new_tp)
                moved = stats["bytes_sent"] + stats["bytes_local"]
                return directory, {"reshard_mb": moved / 1e6, "reshard_s": stats["seconds"],
                                   "reshard_rounds": stats["rounds"]}

            self._switch_metrics = await self.rollout.switch(tp, write)
        self._preemptions_at_start = (await self.rollout.stats()).preemptions

    async def after_round(self, round_type: str) -> dict[str, float]:
        """Feed the round's preemptions to the online rule; metrics under planner/*."""
        preemptions = (await self.rollout.stats()).preemptions - self._preemptions_at_start
        decision = self.planner.observe(round_type, preemptions)
        if decision.changed:
            log.info("planner: %s rounds go from TP %d to TP %d (%s, %d preemptions)", round_type,
                     decision.old_tp, decision.new_tp, decision.reason, preemptions)
        m = {
            "planner/rollout_tp": float(self.rollout.tp),
            "planner/preemptions": float(preemptions),
            "planner/next_tp": float(decision.new_tp),
            "planner/switched": float(bool(self._switch_metrics)),
        }
        for key in ("switch_s", "reshard_mb", "reshard_s", "reshard_rounds"):
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
    from rollpacker.planner import legal_tp_sizes, planner_for_run

    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    per_node = cfg.cluster.gpus_per_node if on_gpu else devices
    sizes = legal_tp_sizes(read_qwen2_arch(cfg.model.hf_path), per_node, devices, cfg.planner.max_tp)
    planner = planner_for_run(cfg, sizes)
    return ElasticTP(cfg, planner, ElasticRollout(engine, cfg.rollout.tensor_parallel_size, factory))

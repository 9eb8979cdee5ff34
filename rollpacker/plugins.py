"""RollPacker, plugged into the loop: importing this module registers everything.

* the ``tail_batching`` scheduler (``scheduler.name=tail_batching``);
* the ``tail_batching``, ``stream`` and ``planner`` config sections and the checks of RollPacker's settings
  (``rollpacker.config``);
* the plug-in factory :func:`build`, which turns those sections into trainer plug-ins:
  the stream trainer when ``stream.enabled``, the elastic-TP planner (wrapping the engines so it
  can rebuild them at another TP) when ``planner.enabled``.

The ``rollpacker`` entry point of the ``megatron_rl.plugins`` group names this module, so
``megatron_rl.config.plugins.load_plugin_packages`` imports it before a config is parsed; nothing in
``megatron_rl`` names RollPacker.
"""
from __future__ import annotations

from megatron_rl.config.plugins import register_plugin_factory, register_scheduler
from megatron_rl.loop.hooks import PluginSet, PluginSetup, TrainerPlugin
from rollpacker.config import PlannerConfig, StreamConfig  # importing it registers the sections and their checks


def build(setup: PluginSetup) -> PluginSet:
    """RollPacker's plug-ins for this run, in call order: the stream trainer first (it sees each
    group the moment it completes), then the planner."""
    cfg, engine = setup.cfg, setup.engine
    plugins: list[TrainerPlugin] = []
    if cfg.section(StreamConfig).enabled:
        from rollpacker.stream_trainer import StreamTrainer

        plugins.append(StreamTrainer(cfg))
    if cfg.section(PlannerConfig).enabled:
        from rollpacker.elastic_tp import build_elastic_tp

        elastic = build_elastic_tp(cfg, engine, setup.engine_factory, on_gpu=setup.device == "cuda")
        engine = elastic.rollout  # the loop generates through the elastic wrapper
        plugins.append(elastic)
    return PluginSet(engine=engine, plugins=plugins)


register_scheduler("tail_batching", "rollpacker.tail_batching:TailBatchingScheduler")
register_plugin_factory("rollpacker.plugins:build")

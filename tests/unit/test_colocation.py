"""The device-memory owner: the order of engine sleep/wake and trainer offload/reload in every
named transition, with fakes that record what was asked of them (the real moves are checked on
Megatron in tests/integration/test_memory_features.py and on vLLM in test_vllm_engine.py)."""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.weight_sync.interface import WeightTransport
from megatron_rl.rollout.weight_sync.sync import WeightSync
from megatron_rl.training.colocation import Colocation


class Moves:
    """Fake trainer ranks and engine sharing one record of calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.active_engines = 2

    async def free_grad_buffers(self):
        self.calls.append("trainer.free_grads")

    async def offload_for_rollout(self):
        self.calls.append("trainer.offload")

    async def reload_for_training(self, ranks=None):
        self.calls.append("trainer.reload" if ranks is None else f"trainer.reload(ranks {ranks})")

    async def set_num_threads(self, n, ranks=None):
        self.calls.append(f"trainer.threads({n})" if ranks is None else f"trainer.threads({n}, ranks {ranks})")

    async def sleep(self, level=1):
        self.calls.append("engine.sleep" if level == 1 else f"engine.sleep(level {level})")

    async def wake_up(self, tags=None):
        self.calls.append("engine.wake_up" if tags is None else f"engine.wake_up({','.join(tags)})")

    async def release_engines(self, count, members=None, level=1):
        self.calls.append(f"engine.release({members}, level {level})")
        return {"released_engines": float(count)}

    async def restore_engines(self):
        self.calls.append("engine.restore")
        return {}


def colocation(offload: bool, sleep: bool, on_cpu: bool = True, level: int = 1) -> tuple[Colocation, Moves]:
    cfg = RunConfig()
    cfg.trainer.offload_during_rollout, cfg.rollout.sleep_during_train = offload, sleep
    cfg.rollout.sleep_level = level
    moves = Moves()
    return Colocation(cfg, moves, moves, on_cpu=on_cpu), moves


def test_a_step_sleeps_the_engines_before_the_trainer_returns_and_offloads_before_they_wake():
    async def main():
        col, moves = colocation(offload=True, sleep=True)
        timings = await col.to_training()
        assert set(timings) == {"time/engine_sleep", "time/trainer_reload"}
        assert moves.calls == ["engine.sleep", "trainer.reload"]
        await col.to_training()  # idempotent: nothing moves twice
        await col.to_rollout()
        assert moves.calls == ["engine.sleep", "trainer.reload", "trainer.offload", "engine.wake_up"]
        assert col.log == moves.calls

    asyncio.run(main())


@pytest.mark.parametrize("offload, sleep, expected", [
    (False, False, []),
    (False, True, ["engine.sleep", "engine.wake_up"]),
    (True, False, ["trainer.reload", "trainer.offload"]),
])
def test_each_option_alone_moves_only_its_part(offload, sleep, expected):
    async def main():
        col, moves = colocation(offload, sleep)
        await col.to_training()
        await col.to_rollout()
        return moves.calls

    assert asyncio.run(main()) == expected


def test_a_checkpoint_save_brings_the_trainer_back_and_restores_the_rollout_side():
    async def main():
        col, moves = colocation(offload=True, sleep=True)
        async with col.training_side():
            moves.calls.append("save")
        assert moves.calls == ["engine.sleep", "trainer.reload", "save", "trainer.offload", "engine.wake_up"]
        # Without offload the trainer never left: a save moves nothing (also with sleep).
        col, moves = colocation(offload=False, sleep=True)
        async with col.training_side():
            moves.calls.append("save")
        assert moves.calls == ["save"]

    asyncio.run(main())


def test_an_export_for_new_engines_makes_the_trainer_resident_only_for_its_duration():
    async def main():
        col, moves = colocation(offload=True, sleep=True)
        async with col.trainer_resident():
            moves.calls.append("export")
        assert moves.calls == ["trainer.reload", "export", "trainer.offload"]
        await col.to_training()  # the step after: the trainer comes back as usual
        async with col.trainer_resident():  # already resident: nothing moves
            moves.calls.append("export")
        assert moves.calls[-3:] == ["engine.sleep", "trainer.reload", "export"]

    asyncio.run(main())


def test_lending_engines_to_a_stream_and_giving_them_back():
    async def main():
        col, moves = colocation(offload=True, sleep=False, on_cpu=True)
        figures = await col.lend_engines([1], train_threads=2)  # no ranks named: the trainer has GPUs of its own
        assert figures == {"released_engines": 1.0}
        await col.make_trainer_resident()  # every streamed chunk asks: free after the first
        await col.return_engines()
        await col.to_training()  # rollout over: the trainer is already resident
        assert moves.calls == ["engine.release([1], level 2)", "trainer.reload", "trainer.threads(2)", "engine.restore",
                               "trainer.threads(1)"]
        # On a GPU the lent devices are the engines' memory, not cores: no thread change.
        col, moves = colocation(offload=False, sleep=False, on_cpu=False)
        await col.lend_engines([1], train_threads=2)
        await col.return_engines()
        assert moves.calls == ["engine.release([1], level 2)", "engine.restore"]

    asyncio.run(main())


def test_a_lent_engine_brings_back_only_the_trainer_ranks_on_its_gpus():
    """The freed replicas' ranks come back (and get the freed cores); the others stay offloaded beside the
    engines that keep generating, and return with the move to training after the round; an offload then
    takes every rank out again."""
    async def main():
        col, moves = colocation(offload=True, sleep=True, on_cpu=True, level=2)
        await col.lend_engines([1], ranks=[2, 3], train_threads=2)
        await col.make_trainer_resident([2, 3])  # a streamed chunk on the same replicas: nothing moves
        assert not col.trainer_is_resident and col.resident_ranks == {2, 3}
        await col.return_engines()
        await col.to_training()
        assert col.trainer_is_resident
        await col.to_rollout()
        assert moves.calls == ["engine.release([1], level 2)", "trainer.reload(ranks [2, 3])",
                               "trainer.threads(2, ranks [2, 3])", "engine.restore", "trainer.threads(1, ranks [2, 3])",
                               "engine.sleep(level 2)", "trainer.reload", "trainer.offload", "engine.wake_up"]
        # An offload with only some ranks back still takes them out.
        col, moves = colocation(offload=True, sleep=False, on_cpu=False)
        await col.make_trainer_resident([0, 1])
        await col.offload_trainer()
        assert moves.calls == ["trainer.reload(ranks [0, 1])", "trainer.offload"] and col.resident_ranks == set()

    asyncio.run(main())


class _RecordingTransport(WeightTransport):
    def __init__(self, moves: Moves, streams: bool, writes: bool) -> None:
        super().__init__(moves, "/shm/w", "float32")
        self.moves, self.streams_from_trainer, self.writes_directory = moves, streams, writes

    async def stage(self, version, tp):
        self.moves.calls.append(f"stage(v{version},tp{tp})")
        return {"staged": 1.0}

    async def load(self, engine, version):
        self.moves.calls.append(f"load(v{version})")
        return {"loaded": 1.0}


@pytest.mark.parametrize("streams, expected", [
    # Only the engines' weights are woken for the load; their KV cache after it (the push moment of
    # megatron_rl.planning.moments: trainer state, engine weights and KV cache never all at once).
    (False, ["stage(v3,tp2)", "fan_out(/shm/w)", "trainer.offload", "engine.wake_up(weights)", "load(v3)",
             "engine.wake_up(kv_cache)"]),
    # A tensor transport reads trainer memory while the engines receive: grads freed, weights, load,
    # offload, KV cache.
    (True, ["stage(v3,tp2)", "trainer.free_grads", "engine.wake_up(weights)", "load(v3)", "trainer.offload",
            "engine.wake_up(kv_cache)"]),
])
def test_weight_sync_orders_memory_around_its_transport(streams, expected):
    async def main():
        col, moves = colocation(offload=True, sleep=True)
        await col.to_training()
        moves.calls.clear()

        class Engine:
            tensor_parallel_size = 2

        async def fan_out(directory):
            moves.calls.append(f"fan_out({directory})")
            return {"fanout_mb": 5.0}

        sync = WeightSync(_RecordingTransport(moves, streams, writes=not streams), moves, Engine(), col, fan_out)
        metrics = await sync.push(3)
        return moves.calls, metrics

    calls, metrics = asyncio.run(main())
    assert calls == expected
    assert metrics["weight_sync/staged"] == 1.0 and metrics["weight_sync/loaded"] == 1.0
    assert ("weight_sync/fanout_mb" in metrics) == (not streams)


def test_only_the_sleep_before_a_push_drops_the_weights():
    """rollout.sleep_level=2 applies to the sleep through training (a push follows and rewrites the
    weights); a checkpoint save's sleep is level 1, since the engines wake without a push."""
    async def main():
        col, moves = colocation(offload=True, sleep=True, level=2)
        await col.to_training()
        await col.to_rollout()
        async with col.training_side():
            moves.calls.append("save")
        return moves.calls

    assert asyncio.run(main()) == ["engine.sleep(level 2)", "trainer.reload", "trainer.offload", "engine.wake_up",
                                   "engine.sleep", "trainer.reload", "save", "trainer.offload", "engine.wake_up"]


def test_gradients_freed_before_a_push_come_back_before_training_even_if_the_push_failed():
    async def main():
        col, moves = colocation(offload=True, sleep=False)
        await col.to_training()
        await col.free_trainer_grads()
        await col.free_trainer_grads()  # once
        await col.to_training()  # the push failed before the offload: the grad buffers must come back
        plain, kept = colocation(offload=False, sleep=True)
        await plain.free_trainer_grads()  # without the offload nothing reloads them: never freed
        return moves.calls, kept.calls

    calls, kept = asyncio.run(main())
    assert calls == ["trainer.reload", "trainer.free_grads", "trainer.reload"] and kept == []

"""Stream trainer policy: when streaming starts, chunking, exactly-once coverage, engine release.

The loop is replaced by a recording stand-in of its services (``LoopServices``) with the real
device-memory owner (``Colocation``) in it; the real Megatron accumulation is checked in
tests/integration/test_stream_accumulation.py, the loop's calls in tests/unit/test_trainer.py and
the whole loop in tests/integration/test_rollpacker_loop.py.
"""
from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.loop.hooks import RolloutBatch
from megatron_rl.rollout.engine import EngineStats
from megatron_rl.sample import Prompt, Sample
from megatron_rl.training.colocation import Colocation
from rollpacker.stream_trainer import StartRule, StreamTrainer


def make_group(i: int, r0: int = 2) -> list[Sample]:
    prompt = Prompt(prompt_id=f"p{i}", token_ids=[1, 2], answer="0")
    return [Sample(prompt=prompt, response_index=k, request_id=f"p{i}-{k}", response_ids=[3] * (i + 1))
            for k in range(r0)]


def stream_cfg(**stream) -> RunConfig:
    cfg = RunConfig()
    cfg.stream.enabled = True
    for key, value in stream.items():
        setattr(cfg.stream, key, value)
    return cfg


class Recorder:
    """Stands in for the loop's services and the trainer ranks: records chunks, the final update
    and the thread counts the colocation owner sets."""

    def __init__(self) -> None:
        self.chunks: list[list[str]] = []
        self.chunk_replicas: list[list[int] | None] = []
        """Per chunk, the DP replicas it was trained on (None: every replica)."""
        self.applied: list[list[str]] = []
        self.threads: list[int] = []
        self.thread_ranks: list[list[int] | None] = []
        self.reloads: list[list[int] | None] = []

    async def train_groups(self, groups, replicas=None):
        await asyncio.sleep(0)
        self.chunks.append([g[0].prompt.prompt_id for g in groups])
        self.chunk_replicas.append(replicas)
        return [s for g in groups for s in g]

    async def apply_gradients(self, samples):
        self.applied.append([s.request_id for s in samples])
        return {"loss": 1.0}

    async def set_num_threads(self, n: int, ranks=None) -> None:
        self.threads.append(n)
        self.thread_ranks.append(ranks)

    async def free_grad_buffers(self) -> dict:
        return {}

    async def offload_for_rollout(self) -> dict:
        return {}

    async def reload_for_training(self, ranks=None) -> dict:
        self.reloads.append(ranks)
        return {}


class FakeLoop:
    """LoopServices for the stream trainer: the recorder's training, the real Colocation."""

    def __init__(self, cfg: RunConfig, engine, rec: Recorder, on_cpu: bool = True) -> None:
        self.cfg, self.engine, self.version, self.weight_sync = cfg, engine, 0, None
        self.colocation = Colocation(cfg, rec, engine, on_cpu=on_cpu)
        self.train_groups, self.apply_gradients = rec.train_groups, rec.apply_gradients


def make_stream(cfg: RunConfig, pool, rec: Recorder, on_cpu: bool = True) -> StreamTrainer:
    stream = StreamTrainer(cfg)
    stream.attach(FakeLoop(cfg, pool, rec, on_cpu))
    return stream


class PoolStub:
    """Engine-pool stand-in: reports a running count and records release/restore."""

    tensor_parallel_size = 1

    def __init__(self, running: int) -> None:
        self.running = running
        self.active_engines = 2
        self.calls: list[str] = []
        self.routed = [0, 0]

    async def stats(self) -> EngineStats:
        return EngineStats(running=self.running, extra={"routed_in_flight": list(self.routed)})

    async def release_engines(self, count: int, members=None, level: int = 1) -> dict:
        self.calls.append(f"release {count}")
        self.released = (list(members or []), level)
        return {"released_engines": count, "migrated_requests": 3, "migrated_tokens": 40, "release_s": 0.01}

    async def restore_engines(self) -> None:
        self.calls.append("restore")


async def feed(stream: StreamTrainer, step: int, groups: list[list[Sample]], before_each=None) -> None:
    for i, group in enumerate(groups):
        if before_each:
            before_each(i)
        stream.on_group_complete(step, group)
        for _ in range(5):  # let the driver task run (it awaits the recorder)
            await asyncio.sleep(0)


def run_long_round(cfg: RunConfig, pool: PoolStub, rec: Recorder, groups: list[list[Sample]], before_each=None,
                   on_cpu: bool = True):
    """One long round of ``groups`` through a StreamTrainer; returns its TrainResult."""

    async def main():
        stream = make_stream(cfg, pool, rec, on_cpu)
        stream.on_round_start(0, "long", len(groups))
        await feed(stream, 0, groups, before_each=before_each)
        return await stream.finish(0, groups)

    return asyncio.run(main())


def test_start_rule_checks_in_steps_and_forces_the_last_mark():
    cfg = stream_cfg()
    rule = StartRule(20, cfg.stream)
    assert rule.marks == pytest.approx([0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5])
    assert rule.crossed(3) is None            # 15 %: no check yet
    assert rule.crossed(4) == pytest.approx(0.2)
    assert rule.crossed(4) is None            # no new prompts since the last check
    assert rule.crossed(7) == pytest.approx(0.35)  # 0.25, 0.3 and 0.35 crossed at once: one check
    assert not rule.should_start(0.35, requests_fit=False)
    assert rule.should_start(0.35, requests_fit=True)
    assert rule.should_start(0.5, requests_fit=False)


def test_long_round_streams_chunks_after_the_start_and_trains_every_group_once():
    cfg = stream_cfg(min_new_groups=2)
    rec = Recorder()
    groups = [make_group(i) for i in range(10)]

    async def main():
        stream = make_stream(cfg, PoolStub(0), rec)
        stream.on_round_start(0, "long", 10)
        assert stream.streaming(0)
        await feed(stream, 0, groups)
        return await stream.finish(0, groups)

    result = asyncio.run(main())
    # 2 of 10 groups = the 20 % mark: the first chunk holds exactly those.
    assert rec.chunks[0] == ["p0", "p1"]
    assert all(len(c) >= 2 for c in rec.chunks[:-1])
    flat = [pid for chunk in rec.chunks for pid in chunk]
    assert sorted(flat) == sorted(f"p{i}" for i in range(10)) and len(flat) == 10
    assert len(rec.applied) == 1 and len(rec.applied[0]) == 20
    assert [s.request_id for s in result.trained] == rec.applied[0]
    assert result.metrics["stream/started"] == 1.0
    assert result.metrics["stream/start_fraction"] == pytest.approx(0.2)
    assert result.train_metrics == {"loss": 1.0}


def test_train_checks_the_streamed_update_covers_exactly_the_prepared_samples():
    """As a plug-in it takes over the step and checks coverage itself: a prepared sample that
    was never streamed (or one too many) is an error, not a silently different update."""
    cfg = stream_cfg(min_new_groups=1)
    groups = [make_group(i) for i in range(4)]

    async def one_round(prepared):
        rec = Recorder()
        stream = make_stream(cfg, PoolStub(0), rec)
        stream.on_round_start(0, "long", 4)
        assert stream.takes_over_training(0) and not stream.takes_over_training(1)
        await feed(stream, 0, groups)
        return await stream.train(0, RolloutBatch(groups=groups, round_type="long"), prepared)

    everything = [s for g in groups for s in g]
    result = asyncio.run(one_round(everything))
    assert sorted(s.request_id for s in result.trained) == sorted(s.request_id for s in everything)
    with pytest.raises(RuntimeError, match=r"trained 8 samples, expected 6 .*unexpected \['p3-0', 'p3-1'\]"):
        asyncio.run(one_round(everything[:6]))  # e.g. the loop's filter dropped p3 but streaming trained it


def test_other_round_types_do_not_stream():
    cfg = stream_cfg(rounds="long")
    rec = Recorder()

    async def main():
        stream = make_stream(cfg, PoolStub(0), rec)
        stream.on_round_start(3, "short", 4)
        await feed(stream, 3, [make_group(i) for i in range(4)])
        return stream.streaming(3)

    assert asyncio.run(main()) is False
    assert rec.chunks == []


def test_groups_finishing_after_rollout_are_trained_in_finish_and_fraction_is_reported():
    cfg = stream_cfg(min_new_groups=1)
    rec = Recorder()
    groups = [make_group(i) for i in range(10)]

    async def main():
        stream = make_stream(cfg, PoolStub(0), rec)
        stream.on_round_start(1, "long", 10)
        await feed(stream, 1, groups[:5])
        # The scheduler's batch holds all 10; 5 arrive with the batch (e.g. in one burst).
        return await stream.finish(1, groups)

    result = asyncio.run(main())
    assert rec.chunks[-1] == [f"p{i}" for i in range(5, 10)]
    assert result.metrics["stream/trained_fraction_before_rollout_end"] == pytest.approx(0.5)
    assert len(result.trained) == 20


def test_a_streamed_group_missing_from_the_batch_is_an_error():
    cfg = stream_cfg(min_new_groups=1)
    rec = Recorder()
    groups = [make_group(i) for i in range(4)]

    async def main():
        stream = make_stream(cfg, PoolStub(0), rec)
        stream.on_round_start(0, "long", 4)
        await feed(stream, 0, groups)
        await stream.finish(0, groups[1:])

    with pytest.raises(RuntimeError, match="not in the step's batch"):
        asyncio.run(main())
    assert rec.applied == []


def test_release_waits_until_running_requests_fit_then_gives_everything_back():
    cfg = stream_cfg(release_engines=1, train_threads=2, min_new_groups=1)
    cfg.rollout.num_engines, cfg.rollout.max_num_seqs = 2, 8
    rec = Recorder()
    pool = PoolStub(running=20)  # does not fit on one engine of 8
    groups = [make_group(i) for i in range(20)]

    def shrink(i: int) -> None:
        # At 30 % complete (6 groups) the running requests drop to what one engine holds.
        if i == 5:
            pool.running = 8

    result = run_long_round(cfg, pool, rec, groups, before_each=shrink)
    assert result.metrics["stream/start_fraction"] == pytest.approx(0.3)
    assert rec.chunks[0] == [f"p{i}" for i in range(6)]
    assert pool.calls == ["release 1", "restore"]
    assert rec.threads == [2, 1]
    assert result.metrics["stream/migrated_requests"] == 3.0


def test_release_starts_at_the_last_mark_even_when_requests_never_fit():
    cfg = stream_cfg(release_engines=1, min_new_groups=1)
    cfg.rollout.num_engines, cfg.rollout.max_num_seqs = 2, 8
    rec = Recorder()
    pool = PoolStub(running=100)
    groups = [make_group(i) for i in range(20)]

    result = run_long_round(cfg, pool, rec, groups)
    assert result.metrics["stream/start_fraction"] == pytest.approx(0.5)
    assert result.metrics["stream/start_mark"] == pytest.approx(0.5)
    assert pool.calls == ["release 1", "restore"]


HALF_A_REPLICA = ["stream.enabled=true", "stream.release_engines=1", "rollout.num_engines=4",
                  "parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2", "cluster.num_cpus=16"]


@pytest.mark.parametrize("overrides, key", [
    (["stream.enabled=true", "algorithm.ppo_mini_batches=2"], "algorithm.ppo_mini_batches"),
    (["stream.enabled=true", "stream.release_engines=1"], "stream.release_engines"),
    # On GPUs, two trainer ranks (TP2) per replica beside TP-1 engines: one engine frees half a replica.
    ([*HALF_A_REPLICA, "cluster.device=cuda"], r"stream\.release_engines=1: .*the smallest is 2"),
    (["stream.enabled=true", "stream.release_engines=1", "rollout.num_engines=2", "cluster.placement=split",
      "cluster.num_nodes=2"], "cluster.placement=split"),
    (["stream.rounds=long,medium"], "stream.rounds"),
    (["stream.start_fraction_min=0.6"], "stream.start_fraction_min"),
    (["stream.check_interval=0"], "stream.check_interval"),
    (["stream.min_new_groups=0"], "stream.min_new_groups"),
])
def test_bad_stream_config_names_the_key(overrides, key):
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.validation import validate
    from megatron_rl.config.values import ConfigError

    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=key if ".*" in key else key.replace(".", r"\.")):
        validate(cfg, device="cpu")


def test_good_stream_config_validates():
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.validation import validate

    cfg = load_config(None, ["stream.enabled=true", "stream.release_engines=1", "rollout.num_engines=2",
                             "stream.rounds=long,baseline"])
    validate(cfg, device="cpu")
    # On CPU the trainer may share the cores: a release that frees no whole replica is allowed (every
    # replica streams, test_a_cpu_release_that_frees_no_whole_replica_streams_on_every_replica).
    validate(load_config(None, [*HALF_A_REPLICA, "cluster.device=cpu"]), device="cpu")


def test_a_release_frees_whole_replicas_and_only_they_stream_then_every_replica_takes_the_rest():
    """Trainer DP2 beside two engines: engine e shares its GPU with replica e. The released engine (the
    less loaded, asleep at level 2) frees its replica; only that replica's rank comes back and gets the
    freed cores, and every streamed chunk goes to it; after the round both replicas take the rest."""
    cfg = stream_cfg(release_engines=1, train_threads=2, min_new_groups=1)
    cfg.rollout.num_engines, cfg.parallel.data_parallel_size = 2, 2
    cfg.trainer.offload_during_rollout = True
    rec = Recorder()
    pool = PoolStub(running=0)
    pool.routed = [3, 1]  # engine 1 holds less to migrate
    groups = [make_group(i) for i in range(10)]

    async def main():
        stream = make_stream(cfg, pool, rec)
        stream.on_round_start(0, "long", len(groups))
        await feed(stream, 0, groups[:6])
        await stream.after_rollout(0, None)
        return await stream.finish(0, groups)  # four groups came with the end of the round

    result = asyncio.run(main())
    assert pool.released == ([1], 2)
    assert rec.reloads[0] == [1] and rec.thread_ranks == [[1], [1]] and rec.threads == [2, 1]
    streamed = [replicas for chunk, replicas in zip(rec.chunks, rec.chunk_replicas)][:-1]
    assert streamed and all(r == [1] for r in streamed)
    assert rec.chunk_replicas[-1] == [0, 1]  # the rest: both replicas, split to finish together
    assert result.metrics["stream/released_replicas"] == 1.0 and len(result.trained) == 20


def test_a_cpu_release_that_frees_no_whole_replica_streams_on_every_replica():
    """Trainer TP2 (one replica of two ranks) beside two TP-1 engines: releasing one engine frees half the
    replica. On CPU the trainer may share the cores, so the less loaded engine goes, every rank comes back
    with the freed cores and every chunk is split by the workers (replicas None); on GPUs the same round
    would train after the rollout (test_gpus_without_a_release_do_not_stream_during_the_round)."""
    cfg = stream_cfg(release_engines=1, train_threads=2, min_new_groups=1)
    cfg.rollout.num_engines, cfg.parallel.tensor_model_parallel_size = 2, 2
    rec = Recorder()
    pool = PoolStub(running=0)
    pool.routed = [1, 4]  # engine 0 holds less to migrate
    groups = [make_group(i) for i in range(6)]

    result = run_long_round(cfg, pool, rec, groups)
    assert pool.released == ([0], 2)
    assert rec.thread_ranks == [None, None] and rec.threads == [2, 1]
    assert rec.chunk_replicas and all(r is None for r in rec.chunk_replicas)
    assert result.metrics["stream/released_engines"] == 1.0 and "stream/released_replicas" not in result.metrics


def test_gpus_without_a_release_do_not_stream_during_the_round():
    """On colocated GPUs the trainer may not come back beside generating engines: with nothing released
    (stream.release_engines=0) the round is trained after the rollout, not during it."""
    cfg = stream_cfg(min_new_groups=1)
    cfg.rollout.num_engines = 2
    rec = Recorder()
    groups = [make_group(i) for i in range(6)]

    result = run_long_round(cfg, PoolStub(running=0), rec, groups, on_cpu=False)
    assert rec.chunks == [[f"p{i}" for i in range(6)]] and rec.chunk_replicas == [None]
    assert result.metrics["stream/chunks"] == 1.0 and result.metrics["stream/trained_fraction_before_rollout_end"] == 0.0


def test_no_release_when_only_one_engine_is_active():
    cfg = stream_cfg(release_engines=1, train_threads=2, min_new_groups=1)
    cfg.rollout.num_engines = 2
    rec = Recorder()
    pool = PoolStub(running=0)
    pool.active_engines, pool.tensor_parallel_size = 1, 2  # e.g. the elastic planner runs this round as one TP-2 engine
    groups = [make_group(i) for i in range(4)]

    result = run_long_round(cfg, pool, rec, groups)
    assert pool.calls == [] and rec.threads == []
    assert result.metrics["stream/released_engines"] == 0.0 and len(result.trained) == 8


def test_no_release_while_a_member_is_being_replaced():
    """Two TP-1 engines, one of them restarting when streaming starts (found dead in the round): a release
    then could take the engine that serves, so none is released; on CPU every replica streams anyway, on
    GPUs the round trains after its rollout (the whole-system faults run died of this release once)."""
    for on_cpu in (True, False):
        cfg = stream_cfg(release_engines=1, train_threads=2, min_new_groups=1)
        cfg.rollout.num_engines, cfg.parallel.data_parallel_size = 2, 2
        rec = Recorder()
        pool = PoolStub(running=0)
        pool.active_engines = 1
        groups = [make_group(i) for i in range(4)]

        result = run_long_round(cfg, pool, rec, groups, on_cpu=on_cpu)
        assert pool.calls == [] and rec.threads == [], on_cpu
        assert result.metrics["stream/released_engines"] == 0.0 and len(result.trained) == 8
        assert (result.metrics["stream/trained_fraction_before_rollout_end"] > 0) == on_cpu


def test_released_engines_are_given_back_even_when_every_engine_sleeps_through_training():
    # Whether restored engines wake or stay asleep is the pool's rule (it knows whether it sleeps;
    # see test_engine_pool), so the stream trainer gives them back the same way either way.
    cfg = stream_cfg(release_engines=1, min_new_groups=1)
    cfg.rollout.num_engines, cfg.rollout.sleep_during_train = 2, True
    rec = Recorder()
    pool = PoolStub(running=0)
    groups = [make_group(i) for i in range(4)]

    run_long_round(cfg, pool, rec, groups)
    assert pool.calls == ["release 1", "restore"]


def test_no_handoff_begins_after_the_round_ended():
    """The last groups cross the start mark as the round ends: the loop's after_rollout comes before
    the engines sleep for training, and no release may begin after it (it would wait for the pool
    behind that sleep and find no engine awake to keep)."""
    cfg = stream_cfg(release_engines=1, min_new_groups=1)
    cfg.rollout.num_engines, cfg.rollout.max_num_seqs = 2, 8
    rec = Recorder()
    pool = PoolStub(running=0)
    groups = [make_group(i) for i in range(4)]

    async def main():
        stream = make_stream(cfg, pool, rec)
        stream.on_round_start(0, "long", len(groups))
        for group in groups:  # every group at once: the driver has not run yet when the round ends
            stream.on_group_complete(0, group)
        await stream.after_rollout(0, None)
        for _ in range(5):  # the loop puts the engines to sleep here (Colocation.to_training): others run
            await asyncio.sleep(0)
        return await stream.finish(0, groups)

    result = asyncio.run(main())
    assert pool.calls == [], "a release began after the round ended"
    assert result.metrics.get("stream/released_engines", 0.0) == 0.0 and len(result.trained) == 8

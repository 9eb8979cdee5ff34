"""The driver side of the tensor weight push (``TensorTransport``) over fake trainer ranks and fake
engines: one set-up per set of engines (again after they change), wiring by node (shared memory
on one node, the push group across nodes, everything through the group on request), figures,
failures reported with both sides and within the timeout, and the elastic-TP path through
``WeightSync`` (new engines start from config + tokenizer and get a push, trainer resident)."""
from __future__ import annotations

import asyncio
import json

import pytest

from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.driver.elastic import ElasticRollout
from megatron_rl.rollout.driver.engine_pool import EnginePool
from megatron_rl.rollout.weight_sync.factory import make_transport
from megatron_rl.rollout.weight_sync.push import transport as tensor_transport
from megatron_rl.rollout.weight_sync.push.protocol import LOCAL, NET
from megatron_rl.rollout.weight_sync.push.start_dir import PUSH_MANIFEST, read_push_manifest
from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport, WeightPushError
from megatron_rl.rollout.weight_sync.sync import WeightSync
from megatron_rl.training.colocation import Colocation
from tests.helpers.fake_engine import FakeEngine


class Engine(FakeEngine):
    made = 0

    def __init__(self, node: str = "n0", tp: int = 1, fail: Exception | None = None, hang: bool = False) -> None:
        super().__init__(length_fn=lambda r: 2)
        Engine.made += 1
        self.rid = f"e{Engine.made}"
        self.node, self.tp, self.fail, self.hang = node, tp, fail, hang
        self.opened: list[dict] = []
        self.tensor_parallel_size = tp

    async def weight_receivers(self):
        return [(self.rid, self.node)]

    async def open_weight_receiver(self, init_infos):
        self.opened.append(init_infos[0])
        await super().open_weight_receiver(init_infos)

    async def receive_weights(self, sync_id, version):
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail is not None:
            raise self.fail
        await super().receive_weights(sync_id, version)
        return [{"bytes": 4e6, "seconds": 0.2, "load_s": 0.15, "transport_s": 0.05}]


class Trainer:
    """PushWriter + the colocation's trainer calls, recording everything."""

    def __init__(self, nodes=("n0", "n0"), fail: Exception | None = None, hang: bool = False) -> None:
        self.nodes, self.fail, self.hang = list(nodes), fail, hang
        self.calls: list[str] = []
        self.specs: list[dict] = []

    async def rank_nodes(self):
        return [(n, f"10.0.0.{i}") for i, n in enumerate(self.nodes)]

    async def open_weight_push(self, spec):
        self.specs.append(spec)
        self.calls.append(f"open({spec['key']},tp{spec['rollout_tp']})")
        return [{"path": f"/shm/{spec['key']}-t{r}", "ipc_handle": "", "port": 4321 if r == 0 else 0,
                 "fingerprint": "fp"} for r in range(len(self.nodes))]

    async def join_weight_push(self, key, port):
        self.calls.append(f"join({key},{port})")

    async def push_weights(self, key, sync_id, version):
        self.calls.append(f"push({key},{sync_id},v{version})")
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail is not None:
            raise self.fail
        return {"bytes": 8e6, "net_bytes": 0.0, "pack_s": 0.01, "wait_s": 0.02, "net_s": 0.0, "seconds": 0.1}

    async def close_weight_push(self, key):
        self.calls.append(f"close({key})")

    async def free_grad_buffers(self):
        self.calls.append("free_grads")
        return {}

    async def offload_for_rollout(self):
        self.calls.append("offload")
        return {}

    async def reload_for_training(self):
        self.calls.append("reload")
        return {}


def make(trainer, tmp_path, **options) -> TensorTransport:
    return TensorTransport(trainer, str(tmp_path / "w"), "float32",
                           PushOptions(trainer=(2, 1, 1), hf_path=str(tmp_path / "hf"), **options))


def test_one_set_up_per_set_of_engines_and_local_wiring_on_one_node(tmp_path):
    trainer, engines = Trainer(), [Engine(), Engine()]
    pool = EnginePool(engines)
    push = make(trainer, tmp_path)

    async def main():
        first = await push.load(pool, 1)
        second = await push.load(pool, 2)
        return first, second

    first, second = asyncio.run(main())
    assert trainer.calls == ["open(push1,tp1)", "push(push1,1,v1)", "push(push1,2,v2)"]  # no group: one node
    spec = trainer.specs[0]
    assert spec["wiring"] == [[LOCAL, LOCAL], [LOCAL, LOCAL]] and spec["host"] == "10.0.0.0"
    for e, engine in enumerate(engines):  # each replica maps both rings, with its own consumer slot
        info = engine.opened[0]
        assert info["replica"] == e and info["groups"] == [] and info["net_sources"] == []
        assert {t: v["slot"] for t, v in info["local"].items()} == {"0": e, "1": e}
        assert info["local"]["1"]["path"] == "/shm/push1-t1" and info["fingerprint"] == "fp"
        assert engine.version == 2
    assert first["push_mb"] == 4.0 and first["push_replicas"] == 2.0 and "push_setup_s" in first
    assert first["push_load_s"] == 0.15 and first["push_transport_s"] == pytest.approx(first["push_s"] - 0.15)
    assert "push_setup_s" not in second


def test_engines_on_other_nodes_go_through_the_push_group(tmp_path):
    trainer, engines = Trainer(nodes=("n0", "n1")), [Engine("n0"), Engine("n1", tp=1)]
    push = make(trainer, tmp_path)
    asyncio.run(push.load(EnginePool(engines), 1))
    spec = trainer.specs[0]
    assert spec["wiring"] == [[LOCAL, NET], [NET, LOCAL]]
    assert trainer.calls[:2] == ["open(push1,tp1)", "join(push1,4321)"]
    a, b = engines[0].opened[0], engines[1].opened[0]
    assert a["net_sources"] == [1] and b["net_sources"] == [0]
    # One group: trainer ranks 0..1, then replica 0's worker, then replica 1's.
    (ga,), (gb,) = a["groups"], b["groups"]
    assert (ga["ranks"], gb["ranks"]) == ({"0": 2}, {"0": 3})
    assert ga["sources"] == {"0": {"1": 1}} and gb["sources"] == {"0": {"0": 0}}
    assert ga["world_size"] == 4 and ga["host"] == "10.0.0.0" and ga["port"] == 4321
    # rollout.weight_push_channel=network: every pair through the group, even on one node.
    trainer2 = Trainer()
    asyncio.run(make(trainer2, tmp_path, network_only=True).load(Engine(), 1))
    assert trainer2.specs[0]["wiring"] == [[NET], [NET]] and "join(push1,4321)" in trainer2.calls


def test_new_engines_get_a_new_set_up_and_the_old_one_is_closed(tmp_path):
    trainer = Trainer()
    push = make(trainer, tmp_path)

    async def main():
        await push.load(Engine(), 1)
        await push.load(Engine(), 2)  # another engine (an elastic switch built new ones)

    asyncio.run(main())
    assert trainer.calls == ["open(push1,tp1)", "push(push1,1,v1)", "close(push1)", "open(push2,tp1)",
                             "push(push2,2,v2)"]


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_a_failed_push_names_both_sides_and_drops_the_set_up(tmp_path, side):
    boom = RuntimeError("engine 0 TP rank 1 waits for bucket 3/8 from trainer rank 0: nothing after 5 s")
    trainer = Trainer(fail=boom if side == "trainer" else None)
    engine = Engine(fail=boom if side == "engine" else None)
    push = make(trainer, tmp_path)
    with pytest.raises(WeightPushError) as failure:
        asyncio.run(push.load(engine, 4))
    message = str(failure.value)
    assert "policy version 4" in message and "engine 0 (TP1, node n0, e" in message
    assert "waits for bucket 3/8 from trainer rank 0" in message
    assert ("Engines: ok" in message) == (side == "trainer") and ("Trainer ranks: ok" in message) == (side == "engine")
    assert trainer.calls[-1] == "close(push1)"


def test_a_hung_engine_fails_the_push_within_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_transport, "_MARGIN_S", 0.2)
    monkeypatch.setattr(tensor_transport, "_GRACE_S", 0.1)
    trainer = Trainer(fail=TimeoutError("trainer rank 0 ... slot 0 still held by engine 0: nothing after 0 s"))
    push = make(trainer, tmp_path, timeout_s=0.3)

    async def main():
        start = asyncio.get_running_loop().time()
        with pytest.raises(WeightPushError, match="Engines: no answer within 0 s. Trainer ranks: TimeoutError"):
            await push.load(Engine(hang=True), 2)
        return asyncio.get_running_loop().time() - start

    assert asyncio.run(main()) < 5.0


def test_an_engine_that_dies_mid_push_fails_it_at_its_next_health_check(tmp_path, monkeypatch):
    """A dead engine core may never answer the receive call (vLLM leaves the utility call
    pending): the push checks the engines' health while it waits instead of waiting its timeout."""
    monkeypatch.setattr(tensor_transport, "_HEALTH_EVERY_S", 0.05)
    monkeypatch.setattr(tensor_transport, "_GRACE_S", 0.1)
    trainer, engine = Trainer(), Engine(hang=True)  # the trainer side finishes: every bucket fit its ring

    async def dead():
        raise RuntimeError("EngineDeadError: engine core died")

    engine.check_health = dead
    push = make(trainer, tmp_path, timeout_s=60.0)

    async def main():
        start = asyncio.get_running_loop().time()
        with pytest.raises(WeightPushError, match=r"Engines: failed their health check during the push \(RuntimeError: "
                                                  r"EngineDeadError: engine core died\). Trainer ranks: ok"):
            await push.load(engine, 3)
        return asyncio.get_running_loop().time() - start

    assert asyncio.run(main()) < 5.0  # not the 90 s of the push's own limit
    assert trainer.calls[-1] == "close(push1)"


@pytest.mark.parametrize("sleep", [False, True])
def test_elastic_switch_starts_engines_from_config_and_pushes_into_them(tmp_path, sleep):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights")
    cfg = RunConfig()
    cfg.trainer.offload_during_rollout = True
    cfg.rollout.sleep_during_train = sleep
    trainer, built = Trainer(), []

    class NewEngine(Engine):  # records its memory moves among the trainer's calls
        async def sleep(self, level=1):
            trainer.calls.append(f"engine.sleep({level})")
            await super().sleep(level)

        async def wake_up(self, tags=None):
            trainer.calls.append(f"engine.wake_up({','.join(tags or ['all'])})")
            await super().wake_up(tags)

    async def factory(tp, model_dir):
        engine = NewEngine(tp=tp)
        engine.model_dir = model_dir
        built.append(engine)
        return engine

    rollout = ElasticRollout(Engine(), 1, factory)
    colocation = Colocation(cfg, trainer, rollout, on_cpu=True)
    colocation.trainer_is_resident = False  # offloaded, as during a rollout
    sync = WeightSync(make(trainer, tmp_path), trainer, rollout, colocation)

    async def main():
        async def write(tp):
            return await sync.write_for_new_engines(tp, 7)

        async def load(engines):
            return await sync.load_new_engines(engines, 7)

        return await rollout.switch(2, write, load)

    figures = asyncio.run(main())
    start_dir = tmp_path / "w"
    assert built[0].model_dir == str(start_dir)
    assert read_push_manifest(start_dir) == {"format": "megatron_rl.tensor_push/1", "tensor_parallel_size": 2,
                                             "version": 7, "hf_path": str(hf)}
    assert sorted(p.name for p in start_dir.iterdir()) == sorted(["config.json", "tokenizer.json", PUSH_MANIFEST])
    # The new engines' whole pool is never on the GPU with the resident trainer (planning.moments'
    # elastic moment): they sleep first, only their weights wake for the push, the KV cache after it.
    moves = ["reload", "free_grads", "open(push1,tp2)", "push(push1,1,v7)", "offload"]
    if sleep:
        moves = (["engine.sleep(2)"] + moves[:2] + ["engine.wake_up(weights)"] + moves[2:]
                 + ["engine.wake_up(kv_cache)"])
    assert trainer.calls == moves
    assert built[0].version == 7 and figures["push_mb"] == 4.0 and figures["new_tp"] == 2.0


def test_make_transport_builds_the_push_from_the_run_config(tmp_path):
    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.parallel.context_parallel_size = 2
    cfg.rollout.weight_push_bucket_mb = 0.5
    cfg.rollout.weight_push_channel = "network"
    push = make_transport("tensor", Trainer(), str(tmp_path), "bfloat16", cfg, on_gpu=True)
    assert isinstance(push, TensorTransport) and push.streams_from_trainer and not push.writes_directory
    assert push.options.trainer == (2, 1, 2)  # CP ranks hold the weights DP replicas hold
    assert push.options.bucket_bytes == 512 << 10 and push.options.device == "cuda" and push.options.network_only
    with pytest.raises(ValueError, match="is not one of"):
        make_transport("nccl", Trainer(), str(tmp_path), "float32", cfg)

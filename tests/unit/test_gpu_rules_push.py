"""GPU rules of the tensor weight push's pairing (``weight_sync.push.topology``), on fake topologies
(nodes x GPUs x UUIDs) driven through the driver (``TensorTransport``) and real ``PushSender``s:

* CUDA IPC only between a trainer rank and an engine worker on the same GPU (a worker rebuilds an
  IPC handle on its own device only, as vLLM's ``weight_transfer/ipc_engine.py`` does);
* no push group (an NCCL communicator on GPU) holds two processes of one GPU (NCCL refuses it:
  "Duplicate GPU detected");
* every bucket of every trainer rank reaches the engine TP rank it is for in every replica, read
  from what each end opens: the worker's init info and the sender's routes must name one channel;
* on CPU the wiring is by node, as before (a ring on one node, one gloo group for the rest).

Topologies: the three Qwen2.5 recipes (examples/qwen2.5: trainer TP/PP/CP/DP, rollout TP, engine
count, nodes x 8 GPUs) colocated (trainer rank i and engine GPU i share a GPU) and split (engines on
GPUs of their own), plus odd cases. The model is a small Qwen2 with the same parallel splits.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.resharding.push_plan import build_push_plan
from megatron_rl.rollout.weight_sync.push.protocol import PushSpec
from megatron_rl.rollout.weight_sync.push.sender import PushSender
from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport

REPO = Path(__file__).resolve().parents[2]
# 8 KV heads so the 32B recipe's trainer TP 8 divides them (Qwen2.5-32B has 8 too).
ARCH = Qwen2Arch(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=8,
                 max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False)
BUCKET = 16 << 10
GPUS_PER_NODE = 8


@dataclass
class Topology:
    trainer: tuple[int, int, int]
    """Trainer (TP, PP, DP with CP folded in), as the transport plans it."""
    rollout_tp: int
    trainer_gpus: list[tuple[str, str]]
    """(node, GPU UUID) of each trainer rank."""
    engine_gpus: list[list[tuple[str, str]]]
    """(node, GPU UUID) of each TP rank of each engine."""


def gpu(i: int) -> tuple[str, str]:
    """GPU i of the fake cluster: node i // 8, a UUID that names neither (as real ones do not)."""
    return f"node{i // GPUS_PER_NODE}", f"GPU-{(i * 7919) % 100003:05d}-fake"


def recipe(name: str, split: bool = False) -> Topology:
    cfg = yaml.safe_load((REPO / "examples" / "qwen2.5" / name).read_text())
    p, r = cfg["parallel"], cfg["rollout"]
    trainer = (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"],
               p["data_parallel_size"] * p.get("context_parallel_size", 1))
    ranks = trainer[0] * trainer[1] * trainer[2]
    assert ranks == cfg["cluster"]["num_nodes"] * cfg["cluster"]["gpus_per_node"], name
    # Colocated (the hybrid engine): engine GPU i is trainer rank i's; split: engines on the GPUs
    # after the trainer's (their own nodes).
    first = -(-ranks // GPUS_PER_NODE) * GPUS_PER_NODE if split else 0
    tp = r["tensor_parallel_size"]
    return Topology(trainer, tp, [gpu(i) for i in range(ranks)],
                    [[gpu(first + e * tp + k) for k in range(tp)] for e in range(r["num_engines"])])


RECIPES = ["qwen2.5_7b_math_2x8_tp2_rtp1.yaml", "qwen2.5_14b_math_4x8_tp4_rtp2.yaml",
           "qwen2.5_32b_math_8x8_tp8_rtp2.yaml"]


class Trainer:
    """``PushWriter`` whose ranks are real ``PushSender``s at fake places (nothing is sent)."""

    def __init__(self, topo: Topology, device: str) -> None:
        self.topo, self.device = topo, device
        self.senders: list[PushSender] = []

    async def rank_nodes(self):
        return [(node, f"10.0.{i // 256}.{i % 256}") for i, (node, _) in enumerate(self.topo.trainer_gpus)]

    async def rank_gpus(self):
        return [uuid for _, uuid in self.topo.trainer_gpus]

    async def open_weight_push(self, spec):
        push = PushSpec.from_dict(spec)
        plan = build_push_plan(ARCH, *push.trainer, push.rollout_tp, push.bucket_bytes, 2)
        # The senders' buffers stay on the CPU here; their routing is the code under test.
        self.senders = [PushSender(PushSpec.from_dict(spec), plan, t) for t in range(len(self.topo.trainer_gpus))]
        return [{**s.describe(), "fingerprint": plan.fingerprint} for s in self.senders]

    async def join_weight_push(self, key, port, group_ports=None):
        # What each rank learns here (training.weight_push.join_weight_push), not what rank 0 knows.
        for s in self.senders:
            s.spec.port, s.spec.group_ports = port, list(group_ports or [])

    async def push_weights(self, key, sync_id, version):
        return {k: 0.0 for k in ("bytes", "net_bytes", "pack_s", "wait_s", "net_s", "seconds")}

    async def close_weight_push(self, key):
        for s in self.senders:
            s.close()


class Engines:
    """The engine replicas of a topology, as ``EnginePool.weight_receivers`` reports them."""

    def __init__(self, topo: Topology, device: str) -> None:
        self.topo, self.device = topo, device
        self.tensor_parallel_size = topo.rollout_tp
        self.infos: list[dict] = []

    async def weight_receivers(self):
        out = []
        for e, workers in enumerate(self.topo.engine_gpus):
            gpus = [uuid for _, uuid in workers] if self.device == "cuda" else None
            out.append((f"r{e}", workers[0][0]) + ((gpus,) if gpus else ()))
        return out

    async def open_weight_receiver(self, infos):
        self.infos = infos

    async def receive_weights(self, sync_id, version):
        return [{"bytes": 0.0, "seconds": 0.0, "load_s": 0.0} for _ in self.infos]

    async def check_health(self):
        pass


def set_up(topo: Topology, device: str = "cuda", network_only: bool = False):
    """Run one push set-up (and an empty push) through the driver; (trainer, engines, plan)."""
    trainer, engines = Trainer(topo, device), Engines(topo, device)
    push = TensorTransport(trainer, "/nonexistent", "bfloat16",
                           PushOptions(trainer=topo.trainer, hf_path="/nonexistent", bucket_bytes=BUCKET,
                                       device=device, network_only=network_only))
    try:
        asyncio.run(push.load(engines, 1))
        return trainer, engines, build_push_plan(ARCH, *topo.trainer, topo.rollout_tp, BUCKET, 2)
    finally:
        asyncio.run(push.close())


def worker_channels(info: dict, tp_rank: int) -> dict[int, list[tuple]]:
    """Trainer rank -> every channel the worker of ``tp_rank`` opens for it: ("ring", consumer
    slot) or ("group", group index, the trainer's group rank, the worker's group rank)."""
    out: dict[int, list[tuple]] = {}
    for t, ring in info["local"].items():
        if tp_rank in ring.get("ranks", range(info["rollout_tp"])) and ring["path"]:
            out.setdefault(int(t), []).append(("ring", ring["slot"]))
    for g in info.get("groups", []):
        me = g["ranks"].get(str(tp_rank))
        for t, src in g["sources"].get(str(tp_rank), {}).items():
            out.setdefault(int(t), []).append(("group", g["index"], src, me))
    return out


def group_members(trainer: Trainer, engines: Engines) -> dict[int, dict[int, tuple[str, str]]]:
    """Group -> group rank -> (node, GPU) of the process that joins it at that rank, from what
    every end opens (senders' groups, workers' init infos)."""
    members: dict[int, dict[int, tuple[str, str]]] = {}
    sizes: dict[int, int] = {}
    stores = {g["index"]: (g["host"], g["port"]) for info in engines.infos for g in info["groups"]}
    for t, s in enumerate(trainer.senders):
        for g, address in s.group_addresses().items():  # every member meets at one store
            assert stores.get(g, address) == address and address[1] > 0, (t, g, address, stores.get(g))
        for g, me in s.my_groups:
            assert me not in members.setdefault(g, {}), f"group {g}: rank {me} taken twice"
            members[g][me] = trainer.topo.trainer_gpus[t]
    for info in engines.infos:
        for g in info["groups"]:
            sizes[g["index"]] = g["world_size"]
            for r, me in g["ranks"].items():
                assert me not in members.setdefault(g["index"], {}), f"group {g['index']}: rank {me} taken twice"
                members[g["index"]][me] = engines.topo.engine_gpus[info["replica"]][int(r)]
    for g, size in sizes.items():
        assert sorted(members[g]) == list(range(size)), f"group {g}: ranks {sorted(members[g])} of {size}"
    return members


def check_ipc_only_within_a_gpu(trainer: Trainer, engines: Engines) -> int:
    topo, rings = trainer.topo, 0
    for info in engines.infos:
        for r in range(topo.rollout_tp):
            for t, channels in worker_channels(info, r).items():
                if any(c[0] == "ring" for c in channels):
                    rings += 1
                    assert topo.trainer_gpus[t] == topo.engine_gpus[info["replica"]][r], (
                        f"engine {info['replica']} TP rank {r} maps trainer rank {t}'s IPC slots from another GPU: "
                        f"{topo.trainer_gpus[t]} vs {topo.engine_gpus[info['replica']][r]}")
    return rings


def check_no_group_holds_one_gpu_twice(trainer: Trainer, engines: Engines) -> int:
    members = group_members(trainer, engines)
    for g, ranks in members.items():
        gpus = [uuid for _, uuid in ranks.values()]
        assert len(gpus) == len(set(gpus)), f"push group {g} holds two processes of one GPU: {sorted(gpus)}"
    return len(members)


def check_every_bucket_reaches_every_replica(trainer: Trainer, engines: Engines, plan) -> None:
    """Each bucket (trainer rank t -> engine TP rank r) reaches worker r of every replica on
    exactly one channel the worker opened, and the sender hands it to that very channel."""
    assert len(engines.infos) == len(engines.topo.engine_gpus)
    opened = {(info["replica"], r): worker_channels(info, r) for info in engines.infos
              for r in range(engines.topo.rollout_tp)}
    for b in plan.buckets:
        t, r = b.src_rank, b.dst_rank
        sender = trainer.senders[t]
        for info in engines.infos:
            e = info["replica"]
            channels = opened[e, r].get(t, [])
            assert len(channels) == 1, f"engine {e} TP rank {r}: {len(channels)} channels from trainer rank {t}"
            (channel,) = channels
            if channel[0] == "ring":
                assert channel[1] in sender.takers[r], f"trainer rank {t} never puts bucket {b.index} in engine {e}'s ring"
            else:
                _, g, src, me = channel
                assert (g, src) in [(g2, mine) for g2, mine in sender.my_groups], f"trainer rank {t} not rank {src} of {g}"
                assert (g, me) in sender.net_targets[r], f"trainer rank {t} never sends bucket {b.index} to engine {e}"
    # And nothing else: a ring slot handed to a replica whose worker does not read it is never
    # released (the sender would wait for it forever), a send nobody receives hangs too.
    for t, sender in enumerate(trainer.senders):
        for r in range(engines.topo.rollout_tp):
            rings = {c[1] for info in engines.infos for c in opened[info["replica"], r].get(t, []) if c[0] == "ring"}
            sends = {(c[1], c[3]) for info in engines.infos for c in opened[info["replica"], r].get(t, [])
                     if c[0] == "group"}
            assert set(sender.takers[r]) == rings and set(sender.net_targets[r]) == sends, (t, r)


def check_all(topo: Topology, **kw) -> tuple[int, int]:
    trainer, engines, plan = set_up(topo, **kw)
    rings = check_ipc_only_within_a_gpu(trainer, engines)
    groups = check_no_group_holds_one_gpu_twice(trainer, engines)
    check_every_bucket_reaches_every_replica(trainer, engines, plan)
    return rings, groups


def most_groups_per_process(trainer: Trainer, engines: Engines) -> int:
    """The most push groups (NCCL communicators on GPU) any one process joins."""
    joined = [len(s.my_groups) for s in trainer.senders]
    joined += [sum(str(r) in g["ranks"] for g in info["groups"]) for info in engines.infos
               for r in range(engines.topo.rollout_tp)]
    return max(joined)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("split", [False, True], ids=["colocated", "split"])
def test_recipe_pairs_a_shared_gpu_over_ipc_and_the_rest_over_nccl_without_a_duplicate(name, split):
    topo = recipe(name, split=split)
    trainer, engines, plan = set_up(topo)
    rings = check_ipc_only_within_a_gpu(trainer, engines)
    assert check_no_group_holds_one_gpu_twice(trainer, engines) >= 1
    check_every_bucket_reaches_every_replica(trainer, engines, plan)
    # Colocated, every engine worker shares its GPU with exactly one trainer rank: one IPC pair
    # each; split, none.
    assert rings == (0 if split else sum(len(w) for w in topo.engine_gpus))
    # NCCL communicators cost memory and set-up time: a few per process, not one per peer.
    gpus = len({g for g in topo.trainer_gpus} | {g for w in topo.engine_gpus for g in w})
    assert most_groups_per_process(trainer, engines) <= (gpus - 1).bit_length()


def test_a_tp2_engine_over_two_trainer_ranks_gpus_takes_ipc_from_each_on_its_own_rank():
    # One node: trainer TP 2 on GPUs 0, 1; one TP-2 engine on the same two GPUs.
    topo = Topology((2, 1, 1), 2, [gpu(0), gpu(1)], [[gpu(0), gpu(1)]])
    rings, _ = check_all(topo)
    assert rings == 2


def test_an_engine_on_gpus_without_a_trainer_rank_and_two_nodes():
    # Trainer on node 0 GPUs 0-3 (TP 2, DP 2); engine 0 colocated on GPUs 0-1, engine 1 on GPUs
    # 4-5 of node 0 (no trainer rank there), engine 2 on node 1.
    topo = Topology((2, 1, 2), 2, [gpu(i) for i in range(4)], [[gpu(0), gpu(1)], [gpu(4), gpu(5)], [gpu(8), gpu(9)]])
    rings, _ = check_all(topo)
    assert rings == 2


def test_two_engines_sharing_gpus_are_split_into_groups_without_a_duplicate():
    topo = Topology((2, 1, 1), 1, [gpu(0), gpu(1)], [[gpu(2)], [gpu(2)], [gpu(0)]])
    trainer, engines, _ = set_up(topo)
    check_no_group_holds_one_gpu_twice(trainer, engines)
    check_every_bucket_reaches_every_replica(trainer, engines, build_push_plan(ARCH, *topo.trainer, 1, BUCKET, 2))
    # Engines 0 and 1 share GPU 2: their workers never meet in a group.
    assert all(not ("0" in g["ranks"] and g["index"] in {h["index"] for h in engines.infos[1]["groups"]})
               for g in engines.infos[0]["groups"])


def test_network_only_still_pairs_a_shared_gpu_over_ipc():
    """NCCL cannot join two processes of one GPU, so rollout.weight_push_channel=network leaves
    colocated pairs on IPC and sends the rest over NCCL."""
    topo = Topology((2, 1, 1), 1, [gpu(0), gpu(1)], [[gpu(0)], [gpu(1)]])
    rings, _ = check_all(topo, network_only=True)
    assert rings == 2


def test_a_process_without_a_gpu_uuid_fails_the_set_up_naming_it():
    topo = Topology((2, 1, 1), 1, [gpu(0), ("node0", "")], [[gpu(0)]])
    with pytest.raises(ValueError, match="no GPU UUID reported by trainer rank 1"):
        set_up(topo)


@pytest.mark.parametrize("network_only", [False, True])
def test_cpu_wiring_is_by_node_as_before(network_only):
    # Two nodes, no GPUs: rings on one node, one group of every trainer rank and every worker of a
    # replica with a pair across nodes (group ranks: trainer ranks, then those workers in order).
    topo = Topology((2, 1, 2), 2, [("n0", "")] * 2 + [("n1", "")] * 2, [[("n0", "")] * 2, [("n1", "")] * 2])
    trainer, engines, plan = set_up(topo, device="cpu", network_only=network_only)
    for info in engines.infos:
        node = topo.engine_gpus[info["replica"]][0][0]
        for r in range(2):
            for t, channels in worker_channels(info, r).items():
                same = topo.trainer_gpus[t][0] == node and not network_only
                assert [c[0] for c in channels] == ["ring" if same else "group"]
    members = group_members(trainer, engines)
    assert list(members) == [0]
    # Both replicas have a pair across nodes, so all their workers are in it.
    assert [members[0][i] for i in range(len(members[0]))] == topo.trainer_gpus + topo.engine_gpus[0] + topo.engine_gpus[1]
    check_every_bucket_reaches_every_replica(trainer, engines, plan)

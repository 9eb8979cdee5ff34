"""GPU placement rules, held on CPU: a Ray cluster of logical GPUs (eight raylets on this machine,
8 GPUs each, standing in for the nodes of examples/qwen2.5/) and the project's real placing code
(``cluster.place_run`` / ``RunPlacement``, ``PolicyGroup``, ``RayEngineClient.create``,
``engine_factory.EngineFactory``: first start, switches, one member's replacement) starting every trainer rank and engine
as light stand-ins that report where Ray put them (tests/helpers/gpu_stand_ins.py; a TP-k engine
starts its k workers as vLLM 0.32's Ray executor does).

Checked for each recipe shape: no two trainer ranks on one GPU; rank 0 on the driver's node and the
rendezvous address its node's; a TP-k engine on k distinct GPUs of one node, its actor's; no two engine ranks on
one GPU and every rollout GPU used; colocated engine ranks on trainer ranks' GPUs (split: trainer
ranks on the driver's node, engines off it); the dry-run plan (``planning.placement``) equal to what
Ray placed; the same after an elastic TP switch (1->2->1) and after an engine restart.

The 7B shape and the split case start everything at once (the real PolicyGroup and engine pool).
The 14B and 32B shapes would need 80 and 160 processes (too many for a small CI box): their last
node's processes start for real, the others are read off their options and the probed bundles.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "qwen2.5"
NODES, GPUS_PER_NODE = 8, 8


@pytest.fixture(scope="module")
def cluster():
    """Eight raylets of 8 logical GPUs; yields the driver's node id. Bundles hold 2 CPUs per GPU."""
    import ray

    from tests.helpers.ray_dirs import local_ray_cluster

    node = {"num_cpus": 2 * GPUS_PER_NODE, "num_gpus": GPUS_PER_NODE, "object_store_memory": 80 << 20}
    # No worker processes started ahead for the driver: these logical CPUs are not real ones.
    head = {**node, "_system_config": {"prestart_worker_first_driver": False}}
    with local_ray_cluster(head, [node] * (NODES - 1)):
        yield ray.get_runtime_context().get_node_id()


@pytest.fixture
def stand_ins(monkeypatch):
    """The real starting code builds stand-ins instead of Megatron ranks and vLLM engines."""
    from megatron_rl.rollout.driver import ray_engine
    from megatron_rl.training import policy_group
    from tests.helpers.gpu_stand_ins import StandInEngine, StandInRank

    monkeypatch.setattr(policy_group, "TrainerRank", StandInRank)
    monkeypatch.setattr(ray_engine, "EngineActor", StandInEngine)


def _recipe(name: str, *overrides: str):
    from megatron_rl.config.loading import load_config

    return load_config(next(RECIPES.glob(f"qwen2.5_{name}_math_*.yaml")), [*overrides, "cluster.device=cuda"])


def _engine_clients(engine) -> list:
    return list(getattr(engine, "engines", [engine]))


def _where_engines(clients) -> list[dict]:
    import ray

    return ray.get([c.actor.where.remote() for c in clients])


def _kill(actors) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)


def _violations(cfg, ranks: list[dict], engines: list[dict], driver: str, node_ips: dict[str, str]) -> list[str]:
    """Every broken placement rule, one line each (empty: all held)."""
    bad = []
    tp, split = cfg.rollout.tensor_parallel_size, cfg.cluster.placement == "split"
    rank_gpu = []
    for r in ranks:
        if len(r["gpus"]) != 1:
            bad.append(f"trainer rank {r['rank']} holds GPUs {r['gpus']}, not exactly one")
        rank_gpu.append((r["node"], tuple(r["gpus"])))
    shared = {g for g in rank_gpu if rank_gpu.count(g) > 1}
    if shared:
        bad.append(f"two trainer ranks on one GPU: {sorted(shared)[:3]}")
    if ranks[0]["node"] != driver:
        bad.append(f"trainer rank 0 on node {ranks[0]['node'][:8]}, not the driver's {driver[:8]}")
    want_addr = "127.0.0.1" if cfg.cluster.num_nodes == 1 else node_ips[ranks[0]["node"]]
    if any(r["master_addr"] != want_addr for r in ranks):
        bad.append(f"rendezvous address {ranks[0]['master_addr']}, not rank 0's node's {want_addr}")
    engine_gpu = []
    for e, eng in enumerate(engines):
        gpus = eng["ranks"]
        if len(gpus) != tp or len(set(gpus)) != tp:
            bad.append(f"engine {e} (TP {tp}) on GPUs {gpus}: not {tp} distinct GPUs")
        if len({n for n, _ in gpus}) > 1:
            bad.append(f"engine {e}'s TP group crosses nodes")
        # The engine core hands its Ray workers paths on its own node: the logging configuration
        # (vllm_config.logging_config, from rollout/actor/vllm_logging.py; vllm/v1/executor/ray_executor_v2.py
        # applies it in each worker) and the compile cache under its runtime root.
        if any(n != eng["node"] for n, _ in gpus):
            bad.append(f"engine {e}'s TP ranks are not on its actor's node")
        engine_gpu += gpus
    if len(set(engine_gpu)) != len(engine_gpu):
        bad.append("two engine ranks on one GPU")
    if len(set(engine_gpu)) != tp * cfg.rollout.num_engines:
        bad.append(f"{len(set(engine_gpu))} rollout GPUs used, not {tp * cfg.rollout.num_engines}")
    trainer_gpus = {(n, g[0]) for n, g in rank_gpu if len(g) == 1}
    if split:
        if {r["node"] for r in ranks} != {driver} or any(n == driver for n, _ in engine_gpu):
            bad.append("split: trainer ranks off the driver's node or engines on it")
    elif not set(engine_gpu) <= trainer_gpus:
        bad.append(f"engine ranks on {len(set(engine_gpu) - trainer_gpus)} GPU(s) without a trainer rank (not colocated)")
    return bad


def _plan_mismatches(cfg, ranks: list[dict], engines: list[dict], driver: str) -> list[str]:
    """Where the dry-run plan and Ray disagree: plan node i must be one Ray node (node 0 the
    driver's), plan ``gpu<g>`` the GPU with CUDA id g, for every trainer rank and engine rank."""
    from megatron_rl.planning.placement import plan_placement

    planned = {}
    for i, node in enumerate(plan_placement(cfg)):
        for g, slot in enumerate(node.gpus):
            if slot.trainer_rank is not None:
                planned[("rank", slot.trainer_rank)] = (i, g)
            if slot.engine is not None:
                planned[("engine", slot.engine, slot.engine_rank)] = (i, g)
    placed = {("rank", r["rank"]): (r["node"], r["gpus"][0] if r["gpus"] else None) for r in ranks}
    placed.update({("engine", e, k): where for e, eng in enumerate(engines) for k, where in enumerate(eng["ranks"])})
    bad, nodes = [], {0: driver}
    for key in sorted(set(planned) | set(placed), key=str):
        if key not in planned or key not in placed:
            bad.append(f"{key}: planned {planned.get(key)}, placed {placed.get(key)}")
            continue
        (i, g), (node, gpu) = planned[key], placed[key]
        if nodes.setdefault(i, node) != node or g != gpu:
            bad.append(f"{key}: planned node {i} gpu{g}, placed on node {node[:8]} GPU {gpu}")
    if len(set(nodes.values())) != len(nodes):
        bad.append("two plan nodes on one Ray node")
    return bad


def _check(cfg, ranks, engines, driver) -> None:
    import ray

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    problems = _violations(cfg, ranks, engines, driver, ips) + _plan_mismatches(cfg, ranks, engines, driver)
    assert not problems, "\n".join(problems[:12])


def _start_all(cfg):
    """The run's placement, then every rank (PolicyGroup) and engine (the run's EngineFactory) at once."""
    import ray

    from megatron_rl.distributed.cluster import place_run
    from megatron_rl.rollout.driver.engine_factory import EngineFactory
    from megatron_rl.training.policy_group import PolicyGroup

    placement = place_run(cfg, "cuda")
    policy = PolicyGroup(cfg, "cuda", placement.all_trainer_options(), 29500, master_addr=placement.master_addr())
    engine = EngineFactory(cfg, placement, "model").first()
    ranks = ray.get([a.call.remote("where") for a in policy.actors])
    return placement, policy, engine, ranks


def test_7b_colocated_elastic_switch_and_restart(cluster, stand_ins):
    """2x8, trainer TP2 DP8 (16 ranks), 16 TP-1 engines; then TP 2 and back; then a restart."""
    from megatron_rl.rollout.driver.engine_factory import EngineFactory

    cfg = _recipe("7b")
    placement, policy, engine, ranks = _start_all(cfg)
    try:
        before = _where_engines(_engine_clients(engine))
        _check(cfg, ranks, before, cluster)
        factory = EngineFactory(cfg, placement, "model")
        for tp in (2, 1):  # what RollPacker's elastic TP does: the old engines go, the new ones start
            _kill(c.actor for c in _engine_clients(engine))
            engine = asyncio.run(factory(tp, "model"))
            at_tp = _recipe("7b", f"rollout.tensor_parallel_size={tp}", f"rollout.num_engines={16 // tp}")
            _check(at_tp, ranks, _where_engines(_engine_clients(engine)), cluster)
        # An engine restart: member 5 dies alone; its replacement starts on the same GPU by the same rule.
        clients = engine.engines  # the pool's own list: the teardown below kills the replacement too
        _kill([clients[5].actor])
        clients[5] = asyncio.run(factory.start_member(1, "model", 5))
        after = _where_engines(clients)
        _check(cfg, ranks, after, cluster)
        assert [e["ranks"] for e in after] == [e["ranks"] for e in before], "a restarted engine moved"
    finally:
        _kill(c.actor for c in _engine_clients(engine))
        _kill(policy.actors)
        placement.release()


def test_split_keeps_trainer_ranks_on_the_driver_node(cluster, stand_ins):
    """cluster.placement=split on 2x8: 8 trainer ranks on the driver's node, 8 engines on the other."""
    cfg = _recipe("7b", "parallel.data_parallel_size=4", "rollout.num_engines=8", "cluster.placement=split")
    placement, policy, engine, ranks = _start_all(cfg)
    try:
        _check(cfg, ranks, _where_engines(_engine_clients(engine)), cluster)
    finally:
        _kill(c.actor for c in _engine_clients(engine))
        _kill(policy.actors)
        placement.release()


@pytest.mark.parametrize("name", ["14b", "32b"])
def test_larger_recipes(cluster, stand_ins, name):
    """14B 4x8 (TP4 DP8, 16 TP-2 engines) and 32B 8x8 (TP8 DP8, 32 TP-2 engines). The
    processes of the last node start for real (through the same per-rank and per-engine options as
    PolicyGroup and RayEngineClient.create pass on); every other rank and engine is read off its
    options (bundle index) and the probed bundles, so the plan is compared for all of them while
    the test starts 20 processes, not 80 or 160 (the 7B and split cases start everything)."""
    import ray

    from megatron_rl.distributed.cluster import place_run
    from megatron_rl.rollout.driver.ray_engine import RayEngineClient
    from tests.helpers.gpu_stand_ins import StandInRank

    cfg = _recipe(name)
    started = time.monotonic()
    placement = place_run(cfg, "cuda")
    layout, b = placement.layout(), placement.bundles
    rank_opts, engine_opts = placement.all_trainer_options(), placement.engine_options()
    at = {bundle: (node, gpu) for bundle, node, gpu in zip(b.bundle, b.node, b.gpu_id)}

    def bundle_of(opts: dict) -> int:
        return opts["scheduling_strategy"].placement_group_bundle_index

    ranks = [{"rank": r, "node": at[bundle_of(o)][0], "gpus": [at[bundle_of(o)][1]], "master_addr": placement.master_addr()}
             for r, o in enumerate(rank_opts)]
    engines = [{"node": at[bundle_of(o)][0],
                "ranks": [at[int(x)] for x in o["runtime_env"]["env_vars"]["VLLM_RAY_BUNDLE_INDICES"].split(",")]}
               for o in engine_opts]
    try:
        last = cfg.cluster.num_nodes - 1
        mine = [r for r, g in enumerate(layout.trainer_gpus) if layout.node_of(g) == last]
        theirs = [e for e, gpus in enumerate(layout.engine_gpus) if layout.node_of(gpus[0]) == last]
        actors = [ray.remote(StandInRank).options(**rank_opts[r], name=None).remote(
            cfg, r, len(rank_opts), placement.master_addr(), 29500, "cuda") for r in mine]
        clients = [RayEngineClient.create("model", cfg.rollout, e, 4096, actor_options=engine_opts[e],
                                          start_timeout_s=120) for e in theirs]
        for r, where in zip(mine, ray.get([a.call.remote("where") for a in actors])):
            ranks[r] = where
        for e, where in zip(theirs, _where_engines(clients)):
            engines[e] = where
        _kill([*actors, *(c.actor for c in clients)])
        _check(cfg, ranks, engines, cluster)
    finally:
        placement.release()
    print(f"{name}: {len(mine)} ranks, {len(theirs)} engines started, all placed in {time.monotonic() - started:.1f} s")

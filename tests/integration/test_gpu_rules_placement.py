"""GPU placement rules, held on CPU: local Ray clusters of logical GPUs (raylets on this machine
standing in for GPU nodes) and the project's real placing code (``cluster.place_run`` /
``RunPlacement``, ``PolicyGroup``, ``RayEngineClient.create``, ``engine_factory.EngineFactory``:
first start, switches, one member's replacement) starting trainer ranks and engines as light
stand-ins that report where Ray put them (tests/helpers/gpu_stand_ins.py; a TP-k engine starts its
k workers as vLLM 0.32's Ray executor does).

The rules (``_violations``, ``_plan_mismatches``): no two trainer ranks on one GPU; rank 0 on the
driver's node and the rendezvous address its node's; a TP-k engine on k distinct GPUs of one node,
its actor's; no two engine ranks on one GPU and every rollout GPU used; colocated engine ranks on
trainer ranks' GPUs (split: trainer ranks on the driver's node, engines off it); the dry-run plan
(``planning.placement``) equal to what Ray placed.

Each stand-in is a Ray worker process (~2 CPU s of imports), so the rules are held at two levels:

* End to end, on 2 nodes x 4 GPUs (the 7B recipe's layout at half its GPUs per node: two nodes,
  several engines and DP groups on each): every rank through PolicyGroup, every engine through
  EngineFactory. Colocated: first start, elastic TP switches 1->2->1, one member's restart (same
  GPUs); split: first start, a switch to TP 2, a TP-2 member's restart.
* The recipe shapes of examples/qwen2.5/ (7B 2x8 with its switches 1->2->1 and a restart, 7B split,
  14B 4x8, 32B 8x8) on eight raylets of 8 GPUs: the run's placement group is reserved for real
  (``place_run``: PACK, rank 0's bundle on the driver's node, the probed GPU ids); every rank and
  engine is read off the Ray options the placing code hands PolicyGroup and EngineFactory (bundle
  index, ``VLLM_RAY_BUNDLE_INDICES``) and the probed bundles; per stage one engine of the last node
  (its TP group) and the trainer ranks on its GPUs start for real and must be where their options say.
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "qwen2.5"
NODES, GPUS_PER_NODE = 8, 8
"""The recipes' cluster: the 32B recipe's placement group needs eight nodes of 8 GPUs."""
SMALL = ("cluster.gpus_per_node=4", "parallel.data_parallel_size=4", "rollout.num_engines=8")
"""The end-to-end variant of the 7B recipe: 2x4, trainer TP2 DP4 (8 ranks), 8 TP-1 engines."""
SMALL_SPLIT = (*SMALL, "parallel.data_parallel_size=2", "rollout.num_engines=4", "cluster.placement=split")
"""Its split variant: 4 trainer ranks on the driver's node, 4 engines on the other."""


class _Clusters:
    """One local Ray cluster at a time (the driver connects to one), of the shape the test asks for;
    the module's tests come in shape order, so each shape starts once. Bundles hold 2 CPUs per GPU."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.stack = contextlib.ExitStack()
        self.raylets: list[int] = []

    def use(self, nodes: int, gpus: int) -> str:
        """The driver's node id on a cluster of ``nodes`` raylets of ``gpus`` logical GPUs."""
        import ray

        from tests.helpers.gpu_stand_ins import raylet_pids
        from tests.helpers.ray_dirs import local_ray_cluster

        if self.shape != (nodes, gpus):
            self.close()
            node = {"num_cpus": 2 * gpus, "num_gpus": gpus, "object_store_memory": 80 << 20}
            # No worker processes started ahead for the driver (these logical CPUs are not real ones),
            # no dashboard or autoscaler monitor: nothing here reads them.
            head = {**node, "include_dashboard": False, "no_monitor": True,
                    "_system_config": {"prestart_worker_first_driver": False}}
            self.raylets = raylet_pids(self.stack.enter_context(local_ray_cluster(head, [node] * (nodes - 1))))
            self.shape = (nodes, gpus)
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.stack.close()
        self.shape = None


@pytest.fixture(scope="module")
def clusters():
    held = _Clusters()
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def small(clusters):
    """Two raylets of 4 logical GPUs; the driver's node id."""
    return clusters.use(2, 4)


@pytest.fixture
def cluster(clusters):
    """Eight raylets of 8 logical GPUs; the driver's node id."""
    return clusters.use(NODES, GPUS_PER_NODE)


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


def _at_tp(name: str, overrides: tuple[str, ...], cfg, tp: int):
    """The recipe at rollout TP ``tp`` on the same rollout GPUs, built from its overrides (not by the
    switch's own ``at_rollout_tp``, so the rules are held against an independent config)."""
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    return _recipe(name, *overrides, f"rollout.tensor_parallel_size={tp}", f"rollout.num_engines={devices // tp}")


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


def test_colocated_end_to_end_switches_and_restart(small, stand_ins):
    """2x4 colocated, everything started by the real code: 8 trainer ranks and 8 TP-1 engines; then the
    4 TP-2 engines of a switch and the 8 TP-1 engines of the switch back; then member 5 dies alone and
    its replacement starts on the same GPU by the same rule."""
    from megatron_rl.rollout.driver.engine_factory import EngineFactory

    cfg = _recipe("7b", *SMALL)
    placement, policy, engine, ranks = _start_all(cfg)
    try:
        before = _where_engines(_engine_clients(engine))
        _check(cfg, ranks, before, small)
        factory = EngineFactory(cfg, placement, "model")
        for tp in (2, 1):  # what RollPacker's elastic TP does: the old engines go, the new ones start
            _kill(c.actor for c in _engine_clients(engine))
            engine = asyncio.run(factory(tp, "model"))
            _check(_at_tp("7b", SMALL, cfg, tp), ranks, _where_engines(_engine_clients(engine)), small)
        clients = engine.engines  # the pool's own list: the teardown below kills the replacement too
        _kill([clients[5].actor])
        clients[5] = asyncio.run(factory.start_member(1, "model", 5))
        after = _where_engines(clients)
        _check(cfg, ranks, after, small)
        assert [e["ranks"] for e in after] == [e["ranks"] for e in before], "a restarted engine moved"
    finally:
        _kill(c.actor for c in _engine_clients(engine))
        _kill(policy.actors)
        placement.release()


def test_split_end_to_end_switch_and_restart(small, stand_ins):
    """2x4 split, everything started by the real code: 4 trainer ranks on the driver's node, 4 TP-1
    engines on the other; then the 2 TP-2 engines of a switch (workers of whole GPUs, off the driver's
    node); then TP-2 member 1 dies alone and its replacement's workers take the same GPUs."""
    from megatron_rl.rollout.driver.engine_factory import EngineFactory

    cfg = _recipe("7b", *SMALL_SPLIT)
    placement, policy, engine, ranks = _start_all(cfg)
    try:
        _check(cfg, ranks, _where_engines(_engine_clients(engine)), small)
        factory = EngineFactory(cfg, placement, "model")
        _kill(c.actor for c in _engine_clients(engine))
        engine = asyncio.run(factory(2, "model"))
        at_tp2 = _at_tp("7b", SMALL_SPLIT, cfg, 2)
        before = _where_engines(engine.engines)
        _check(at_tp2, ranks, before, small)
        clients = engine.engines
        _kill([clients[1].actor])  # its Ray workers go with it (actors its process owns)
        clients[1] = asyncio.run(factory.start_member(2, "model", 1))
        after = _where_engines(clients)
        _check(at_tp2, ranks, after, small)
        assert [e["ranks"] for e in after] == [e["ranks"] for e in before], "a restarted engine moved"
    finally:
        _kill(c.actor for c in _engine_clients(engine))
        _kill(policy.actors)
        placement.release()


def _by_options(placement, cfg) -> tuple[list[dict], list[dict]]:
    """Every trainer rank and engine of ``cfg`` (the run's, or a switch's config) where the Ray options
    of the placing code put it: the bundle each names (a TP-k engine's workers: VLLM_RAY_BUNDLE_INDICES),
    at the node Ray reserved it on and the GPU id probed in it."""
    b = placement.bundles
    at = {bundle: (node, gpu) for bundle, node, gpu in zip(b.bundle, b.node, b.gpu_id)}

    def bundle_of(opts: dict) -> int:
        return opts["scheduling_strategy"].placement_group_bundle_index

    ranks = [{"rank": r, "node": at[bundle_of(o)][0], "gpus": [at[bundle_of(o)][1]], "master_addr": placement.master_addr()}
             for r, o in enumerate(placement.all_trainer_options())]
    engines = []
    for o in placement.engine_options(cfg):
        named = o.get("runtime_env", {}).get("env_vars", {}).get("VLLM_RAY_BUNDLE_INDICES")
        bundles = [int(x) for x in named.split(",")] if named else [bundle_of(o)]
        engines.append({"node": at[bundle_of(o)][0], "ranks": [at[x] for x in bundles]})
    return ranks, engines


RECIPE_SHAPES = {
    "7b": ("7b", (), (1, 2, 1)),
    "7b-split": ("7b", ("parallel.data_parallel_size=4", "rollout.num_engines=8", "cluster.placement=split"), (1,)),
    "14b": ("14b", (), (2,)),
    "32b": ("32b", (), (2,)),
}
"""Per shape: the recipe, its overrides, and the rollout TP of each stage (the first start, then switches)."""


@pytest.mark.parametrize("shape", list(RECIPE_SHAPES))
def test_recipe_shapes(cluster, clusters, stand_ins, shape):
    """The recipe shapes: 7B 2x8 (TP2 DP8, 16 TP-1 engines; switched to 8 TP-2 engines and back, then
    one member restarted), 7B split (8 ranks on the driver's node, 8 engines on another), 14B 4x8 (TP4
    DP8, 16 TP-2 engines), 32B 8x8 (TP8 DP8, 32 TP-2 engines). The placement group is real and every
    rank and engine is held to the rules where its options and the probed bundles put it; at each
    stage one engine on the last node and the trainer ranks on its GPUs (split: the last rank) start
    for real (EngineFactory.start_member, PolicyGroup's per-rank options) and must be exactly there.
    Probing the bundles' GPU ids starts about one Ray worker per node, not one per GPU."""
    import ray

    from megatron_rl.distributed.cluster import at_rollout_tp, place_run
    from megatron_rl.rollout.driver.engine_factory import EngineFactory
    from tests.helpers.gpu_stand_ins import StandInRank, WorkerStarts

    name, overrides, stages = RECIPE_SHAPES[shape]
    cfg = _recipe(name, *overrides)
    with WorkerStarts(clusters.raylets) as probes:
        placement = place_run(cfg, "cuda")
    # Fewer than one per GPU (max_calls=1, Ray's default for GPU tasks, starts exactly one per bundle): about
    # one per node on a quiet box; under load Ray starts another before the previous probe's is back in its
    # pool (34 for the 32B shape's 64 bundles once), so the bound is the per-GPU count, not the per-node one.
    gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    assert probes.count < gpus, f"{probes.count} worker processes started to probe {gpus} bundles"
    factory = EngineFactory(cfg, placement, "model")
    last = cfg.cluster.num_nodes - 1
    real_ranks: dict[int, object] = {}
    real = None
    try:
        for stage, tp in enumerate(stages):
            at_tp = _at_tp(name, overrides, cfg, tp)
            # The options the switch's own config gets (EngineFactory: at_rollout_tp), held against at_tp.
            ranks, engines = _by_options(placement, at_rollout_tp(cfg, tp))
            if stage == 0:
                first = [eng["ranks"] for eng in engines]
            layout = placement.layout(at_tp)
            e = next(e for e, gpus in enumerate(layout.engine_gpus) if layout.node_of(gpus[0]) == last)
            mine = ([r for r, g in enumerate(layout.trainer_gpus) if g in layout.engine_gpus[e]]
                    or [len(layout.trainer_gpus) - 1])  # split: no rank shares its GPUs; the last one
            for r in mine:
                if r not in real_ranks:  # as PolicyGroup starts rank r: its options, its arguments
                    real_ranks[r] = ray.remote(StandInRank).options(**placement.trainer_options(r), name=None).remote(
                        cfg, r, len(ranks), placement.master_addr(), 29500, "cuda")
            if real is not None:
                _kill([real.actor])  # the switch: the old engine goes, the new one starts
            real = asyncio.run(factory.start_member(tp, "model", e))
            for r, where in zip(mine, ray.get([real_ranks[r].call.remote("where") for r in mine])):
                assert {k: where[k] for k in ("node", "gpus", "master_addr")} == {
                    k: ranks[r][k] for k in ("node", "gpus", "master_addr")}, f"rank {r} is not where its options say"
                ranks[r] = where
            (where,) = _where_engines([real])
            assert (where["node"], where["ranks"]) == (engines[e]["node"], engines[e]["ranks"]), (
                f"engine {e} at TP {tp} is not where its options say")
            engines[e] = where
            _check(at_tp, ranks, engines, cluster)
        if len(stages) > 1:
            # Back at the first TP every engine is where it was; then member e dies alone and its
            # replacement starts on the same GPUs by the same rule.
            assert [eng["ranks"] for eng in engines] == first, "an engine moved across the switches"
            _kill([real.actor])
            real = asyncio.run(factory.start_member(stages[-1], "model", e))
            assert _where_engines([real])[0]["ranks"] == first[e], "a restarted engine moved"
    finally:
        _kill([*real_ranks.values(), *([real.actor] if real else [])])
        placement.release()
    print(f"{shape}: {len(real_ranks)} trainer ranks and {len(stages) + (len(stages) > 1)} engines started, "
          f"{probes.count} worker processes to probe {cfg.cluster.num_nodes * cfg.cluster.gpus_per_node} bundles")

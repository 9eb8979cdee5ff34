"""Light stand-ins for a trainer rank and a vLLM engine actor that only report where Ray put them
(tests/integration/test_gpu_rules_placement.py). They take the real actors' constructor arguments,
so the project's own starting code (``PolicyGroup``, ``RayEngineClient.create``) starts them with the
options the placing code computed.

A TP-k stand-in engine starts its k workers the way vLLM 0.32's Ray executor does from inside an
engine actor: the placement group is the actor's own (``vllm/engine/arg_utils.py``,
``create_engine_config``: ``ray.util.get_current_placement_group()``); the bundles are those in
``VLLM_RAY_BUNDLE_INDICES``, else the first k GPU bundles; each worker is a Ray actor with
``num_cpus=0``, ``num_gpus=VLLM_RAY_PER_WORKER_GPUS`` in its bundle, with Ray's setting of
``CUDA_VISIBLE_DEVICES`` turned off; vLLM then ranks the workers per node and gives local rank ``i``
the node's ``i``-th smallest GPU id of the engine's workers (``vllm/v1/executor/ray_executor.py``,
``_init_workers_ray``). Outside a placement group it reports what vLLM's mp executor would use.
"""
from __future__ import annotations

import asyncio
import contextlib
import os

import ray


def _here() -> dict:
    """This process's node, Ray GPU ids and CUDA_VISIBLE_DEVICES."""
    return {"node": ray.get_runtime_context().get_node_id(), "gpus": [int(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


class StandInRank:
    """In place of ``policy_group.TrainerRank``: same constructor, ``call("where")`` answers."""

    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int, device: str):
        self.rank, self.master_addr = rank, master_addr

    def call(self, name: str, *args):
        if name != "where":
            raise NotImplementedError(f"stand-in trainer rank: {name}")
        return {**_here(), "rank": self.rank, "master_addr": self.master_addr,
                "ip": ray.util.get_node_ip_address()}


class _VllmRayWorker:
    """vLLM's RayWorkerWrapper, as far as placement goes: ``get_node_and_gpu_ids``."""

    def get_node_and_gpu_ids(self) -> dict:
        return _here()


class StandInEngine:
    """In place of ``actor.engine_actor.EngineActor`` (patched where ray_engine creates it; async, like it):
    same constructor, ``where()``."""

    def __init__(self, model_path: str, cfg, seed: int, max_model_len: int) -> None:
        self.tp = cfg.tensor_parallel_size
        self.workers: list = []
        if self.tp == 1:
            return  # vLLM's uni executor: the model runs in the engine's own process, on the actor's GPU
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        self.mp_gpus: list[int] = []
        if pg is None:
            # No placement group: vLLM picks its mp executor (vllm/config/parallel.py) and worker i takes
            # cuda:i of what the actor sees (vllm/v1/executor/multiproc_executor.py); an actor holding no
            # GPU sees every GPU of its node.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            node = next(n for n in ray.nodes() if n["NodeID"] == ray.get_runtime_context().get_node_id())
            ids = [int(g) for g in visible.split(",")] if visible else list(range(int(node["Resources"].get("GPU", 0))))
            self.mp_gpus = ids[:self.tp]
            return
        per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        if os.environ.get("VLLM_RAY_BUNDLE_INDICES"):
            bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
            assert len(bundles) == self.tp and len(set(bundles)) == len(bundles), bundles
        else:
            bundles = [i for i, spec in enumerate(pg.bundle_specs) if spec.get("GPU", 0)][:self.tp]
        noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        self.workers = [ray.remote(num_cpus=0, num_gpus=per_worker, runtime_env=noset, scheduling_strategy=
                                   PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b,
                                                                    placement_group_capture_child_tasks=True))
                        (_VllmRayWorker).remote() for b in bundles]
        self.bundles = bundles

    async def ready(self) -> bool:
        if self.workers:
            await asyncio.gather(*(w.get_node_and_gpu_ids.remote() for w in self.workers))
        return True

    async def where(self) -> dict:
        """The engine's node and, per TP rank, the (node, GPU id) its model shard would use."""
        me = _here()
        if self.tp == 1:
            return {**me, "ranks": [(me["node"], g) for g in me["gpus"]]}
        if not self.workers:
            return {**me, "ranks": [(me["node"], g) for g in self.mp_gpus]}
        seen = await asyncio.gather(*(w.get_node_and_gpu_ids.remote() for w in self.workers))
        # vLLM sorts workers driver-node first and groups them by node (adjusted ranks); on one node the
        # order is unchanged, and local rank i takes the i-th smallest GPU id of the node's workers.
        per_node: dict[str, list[int]] = {}
        for w in seen:
            per_node.setdefault(w["node"], []).extend(w["gpus"])
        local: dict[str, int] = {}
        ranks = []
        for w in seen:
            i = local.get(w["node"], 0)
            local[w["node"]] = i + 1
            ranks.append((w["node"], sorted(per_node[w["node"]])[i]))
        return {**me, "ranks": ranks, "worker_gpus": [w["gpus"] for w in seen]}


class WorkerStarts:
    """The Ray worker processes that start while it watches: new children of the given raylets (a raylet
    starts every worker of its node), sampled in a thread every ``period`` s, so a short-lived worker (a
    task of ``max_calls=1`` exits after one call, ~1 s of imports) is seen too. After the block:
    ``count``, and ``titles`` (each one's last process title, e.g. ``ray::_gpu_ids``) for messages.

    A test asserts with it how many processes the placing code starts (one per node, not one per GPU)."""

    def __init__(self, raylet_pids: list[int], period: float = 0.05) -> None:
        self.raylets, self.period = set(raylet_pids), period
        self.seen: dict[tuple[int, float], str] = {}
        self._before: set[tuple[int, float]] = set()
        self._stop = None
        self._thread = None

    def _sample(self, record: bool) -> None:
        import psutil

        for proc in psutil.process_iter(["ppid", "create_time"]):
            key = (proc.pid, proc.info["create_time"])
            if proc.info["ppid"] not in self.raylets or key[1] is None:
                continue
            if not record:
                self._before.add(key)
            elif key not in self._before:
                with contextlib.suppress(psutil.Error):
                    self.seen[key] = " ".join(proc.cmdline())[:80] or self.seen.get(key, "")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample(record=True)

    def __enter__(self) -> WorkerStarts:
        import threading

        self._sample(record=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-starts", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(record=True)

    @property
    def count(self) -> int:
        return len(self.seen)

    @property
    def titles(self) -> list[str]:
        return sorted(self.seen.values())


def raylet_pids(cluster) -> list[int]:
    """The raylet process of every node of a ``ray.cluster_utils.Cluster`` (``local_ray_cluster``'s)."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    return [info.process.pid for node in nodes for info in node.all_processes.get("raylet", [])]

"""The GPUs of a GPU run as one Ray placement group: one bundle per GPU, in a fixed order.

Rules this follows (Ray 2.60, vLLM 0.32):

* A bundle holds one whole GPU (``{"GPU": 1}``) plus the CPUs of the actors sharing it: vLLM's Ray
  executor refuses bundles of more than one GPU (``vllm/v1/executor/ray_utils.py``,
  ``initialize_ray_cluster``). Actors in a bundle ask for a fraction of its GPU; Ray then gives each
  the bundle's GPU and sets ``CUDA_VISIBLE_DEVICES`` to it (``ray/_private/utils.py``,
  ``set_visible_accelerator_ids``), so two trainer ranks in different bundles never share a GPU.
* Ray numbers bundles in request order, not by node or GPU: each bundle's node comes from
  ``placement_group_table`` and its GPU id from a probe task run in it; sorted (the driver's node
  first, then node id, then GPU id), position ``g`` of that order is GPU ``g`` of
  :mod:`megatron_rl.distributed.gpu_layout`.
* The first bundle is pinned to the driver's node (a ``ray.io/node-id`` bundle label selector) when
  that node has GPUs, so trainer rank 0, which hosts the rendezvous store, runs there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id (what node-label strategies and bundle label selectors match)."""
PROBE_GPUS = 0.01
"""GPU share of a probe task: any share of a one-GPU bundle runs on that bundle's GPU."""


@dataclass
class GpuBundles:
    """The run's placement group and, per sorted position (= layout GPU number), its bundle."""

    pg: Any
    """The Ray ``PlacementGroup``."""
    bundle: list[int]
    """PG bundle index of position ``g``."""
    node: list[str]
    """Ray node id of position ``g``."""
    ip: list[str]
    """IP address of position ``g``'s node."""
    gpu_id: list[int]
    """CUDA id (on its node) of position ``g``'s GPU."""

    def strategy(self, position: int, capture_children: bool = False) -> Any:
        """Scheduling strategy that puts an actor into the bundle at ``position``; with
        ``capture_children`` the actor's own tasks and actors default to this placement group
        (vLLM's Ray executor still names each worker's bundle itself)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=self.bundle[position],
                                                placement_group_capture_child_tasks=capture_children)

    def remove(self) -> None:
        """Give the GPUs back to Ray (the actors in the bundles are killed)."""
        ray.util.remove_placement_group(self.pg)


def reserve_gpus(count: int, cpus_per_gpu: float, timeout_s: float = 300.0) -> GpuBundles:
    """A placement group of ``count`` one-GPU bundles (``cpus_per_gpu`` CPUs each), sorted. Raises
    naming the cluster's GPUs when Ray cannot reserve them within ``timeout_s``."""
    here = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    driver_gpus = next((n["Resources"].get("GPU", 0) for n in alive if n["NodeID"] == here), 0)
    selector = [{} for _ in range(count)]
    if driver_gpus >= 1:
        selector[0] = {NODE_ID_LABEL: here}
    else:
        log.warning("the driver's node has no GPU: trainer rank 0 (the rendezvous store) runs on another node")
    pg = ray.util.placement_group([{"GPU": 1, "CPU": cpus_per_gpu} for _ in range(count)], strategy="PACK",
                                  bundle_label_selector=selector)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        have = ", ".join(f"{n['NodeID'][:12]} {n['Resources'].get('GPU', 0):g} GPU {n['Resources'].get('CPU', 0):g} CPU"
                         for n in alive)
        raise RuntimeError(f"Ray could not reserve {count} GPUs with {cpus_per_gpu:g} CPUs each (cluster.num_nodes x "
                           f"cluster.gpus_per_node) within {timeout_s:.0f} s; alive nodes: {have}")
    return _sorted(pg, here, {n["NodeID"]: n["NodeManagerAddress"] for n in alive})


def _sorted(pg: Any, driver: str, ips: dict[str, str]) -> GpuBundles:
    bundle_node = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    gpu = _probe_gpu_ids(pg, bundle_node)
    order = sorted(bundle_node, key=lambda b: (bundle_node[b] != driver, bundle_node[b], gpu[b], b))
    return GpuBundles(pg, order, [bundle_node[b] for b in order], [ips.get(bundle_node[b], "") for b in order],
                      [gpu[b] for b in order])


def _probe_gpu_ids(pg: Any, bundle_node: dict[int, str]) -> dict[int, int]:
    """CUDA id of every bundle's GPU: a tiny task in each bundle reports ``ray.get_gpu_ids()``.
    One task per node at a time, so each node reuses one worker process instead of starting one
    per GPU: ``max_calls=0`` (no limit), as Ray's default for a task that asks for a GPU is one
    call per worker process (``ray/remote_function.py``: a new Python worker for every probe, 64 of
    them for an 8x8 run). The probe only reads the ids Ray assigned to its call, which Ray sets
    per call, so a reused worker reports each bundle's own GPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(num_cpus=0, num_gpus=PROBE_GPUS, max_calls=0)(_gpu_ids)
    per_node: dict[str, list[int]] = {}
    for b, node in sorted(bundle_node.items()):
        per_node.setdefault(node, []).append(b)
    found: dict[int, int] = {}
    for round_ in range(max(len(v) for v in per_node.values())):
        wave = [bundles[round_] for bundles in per_node.values() if round_ < len(bundles)]
        refs = [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b))
                .remote() for b in wave]
        for b, ids in zip(wave, ray.get(refs)):
            found[b] = int(ids[0])
    return found


def _gpu_ids() -> list:
    return ray.get_gpu_ids()

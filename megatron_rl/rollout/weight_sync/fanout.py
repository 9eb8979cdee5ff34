"""Weight files for engines on other nodes: copy a weights directory from the node that wrote it
to the same path on every other node of the Ray cluster, through Ray's object store.

The trainer writes the per-step HF export (and the rollout shards of an elastic-TP switch) into
a node-local directory, /dev/shm by default, on global rank 0's node; an engine reads the
directory on its own node. In a multi-node run the engines on the other nodes would find
nothing there, so after each write the directory is fanned out: one task pinned to the source
node reads each file into the object store, one task pinned to each other node writes it into
a temp directory beside the target, then swaps it in (``megatron_rl.runtime.files.replace_dir``), so an
engine never sees half a directory. Files travel one at a time (the weight sync writes files
of at most 4 GiB), so the object store holds one file at a time, and Ray moves each between
nodes once per node.

A single-node run never calls this (nothing to copy).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


@ray.remote(num_cpus=0)
def _list_files(directory: str) -> list[str]:
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"weight fan-out: {directory} does not exist on the source node")
    return sorted(p.name for p in root.iterdir() if p.is_file())


@ray.remote(num_cpus=0)
def _read_file(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


@ray.remote(num_cpus=0)
def _start(directory: str) -> str:
    """A fresh temp directory beside ``directory`` on this node."""
    target = Path(directory)
    tmp = target.parent / f".{target.name}.fanout-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return str(tmp)


@ray.remote(num_cpus=0)
def _write_file(tmp: str, name: str, data: np.ndarray) -> int:
    data.tofile(os.path.join(tmp, name))
    return int(data.nbytes)


@ray.remote(num_cpus=0)
def _finish(tmp: str, directory: str) -> str:
    """Swap the completed temp directory in; returns this node's id (for the caller's check)."""
    from megatron_rl.runtime.files import replace_dir

    replace_dir(tmp, directory)
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
def _remove(directory: str) -> str:
    from megatron_rl.rollout.weight_sync.sync_dir import remove_sync_dir

    remove_sync_dir(directory)
    return ray.get_runtime_context().get_node_id()


def remove_on_nodes(directory: str, nodes: list[str]) -> None:
    """End of a multi-node run: delete the fanned-out copies of ``directory`` on ``nodes``."""
    done = ray.get([_remove.options(scheduling_strategy=_on(n)).remote(directory) for n in nodes])
    if done != list(nodes):
        raise RuntimeError(f"weight fan-out: removed on nodes {done}, expected {list(nodes)}")


def other_nodes(source_node: str) -> list[str]:
    """Alive nodes of the Ray cluster other than ``source_node`` (where engines may run)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != source_node)


async def fan_out(directory: str, source_node: str, targets: list[str]) -> dict[str, float]:
    """Copy ``directory`` from ``source_node`` to the same path on each node in ``targets``.

    Returns ``{'fanout_mb': MB written per node, 'fanout_nodes': len(targets), 'fanout_s'}``.
    """
    start = time.monotonic()
    if not targets:
        return {"fanout_mb": 0.0, "fanout_nodes": 0.0, "fanout_s": 0.0}
    names = await _list_files.options(scheduling_strategy=_on(source_node)).remote(directory)
    tmps = await _gather([_start.options(scheduling_strategy=_on(n)).remote(directory) for n in targets])
    written = 0
    for name in names:
        data = _read_file.options(scheduling_strategy=_on(source_node)).remote(os.path.join(directory, name))
        sizes = await _gather([_write_file.options(scheduling_strategy=_on(n)).remote(tmp, name, data)
                               for n, tmp in zip(targets, tmps)])
        written += sizes[0]
        del data  # the object store keeps one file at a time
    finished = await _gather([_finish.options(scheduling_strategy=_on(n)).remote(tmp, directory)
                              for n, tmp in zip(targets, tmps)])
    if finished != list(targets):
        raise RuntimeError(f"weight fan-out: written on nodes {finished}, expected {list(targets)}")
    return {"fanout_mb": written / 1e6, "fanout_nodes": float(len(targets)), "fanout_s": time.monotonic() - start}


async def _gather(refs: list) -> list:
    return list(await asyncio.gather(*refs))

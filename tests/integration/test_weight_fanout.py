"""Weight directories reach engines on other nodes: a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: two raylets, each its own node id and object store) copies a
weight-sync directory from the head node to the worker node through the object store.

Both "nodes" share this machine's filesystem, so the copy lands on the same path as the source:
the test checks that the write ran on the other node (the directory was replaced: new inode),
that every byte is identical, and that no temp or old directory is left behind.
"""
from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def two_nodes():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    from tests.helpers.ray_dirs import short_ray_dir

    if ray.is_initialized():
        ray.shutdown()
    with short_ray_dir("r", room=4) as root, pytest.MonkeyPatch.context() as env:
        # Cluster writes <RAY_TMPDIR>/ray/ray_current_cluster (by default /tmp/ray/..., which a
        # new machine does not have): point it at a directory of this test that exists.
        env.setenv("RAY_TMPDIR", str(root))
        (root / "ray").mkdir()
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": 96 << 20, "temp_dir": str(root / "ray")})
        try:
            worker = cluster.add_node(num_cpus=1, object_store_memory=96 << 20)
            ray.init(address=cluster.address, log_to_driver=False)
            yield ray, ray.get_runtime_context().get_node_id(), worker.node_id
        finally:
            ray.shutdown()
            cluster.shutdown()


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_directory_is_copied_to_the_other_node_whole(two_nodes, tmp_path):
    from megatron_rl.rollout.weight_fanout import fan_out, other_nodes
    from megatron_rl.rollout.weight_sync import write_hf_weights

    _, head, worker = two_nodes
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 256, generator=g) for i in range(6)}
    state["model.embed_tokens.weight"] = torch.randn(320, 64, generator=g)
    # Small shards: several files plus the index, as a large model's sync has.
    weights = write_hf_weights(state, tmp_path / "sync" / "weights", max_shard_bytes=200_000)
    before, inode = digest(weights), os.stat(weights).st_ino
    assert len(before) >= 4 and "model.safetensors.index.json" in before

    assert other_nodes(head) == [worker]
    figures = asyncio.run(fan_out(str(weights), head, [worker]))
    assert figures["fanout_nodes"] == 1.0 and figures["fanout_s"] > 0
    assert figures["fanout_mb"] == pytest.approx(sum(p.stat().st_size for p in weights.iterdir()) / 1e6)
    assert os.stat(weights).st_ino != inode, "the worker node's copy replaced the directory"
    assert digest(weights) == before
    assert sorted(p.name for p in weights.parent.iterdir()) == ["weights"]  # no temp/old dirs left
    assert asyncio.run(fan_out(str(weights), head, [])) == {"fanout_mb": 0.0, "fanout_nodes": 0.0, "fanout_s": 0.0}


def test_a_missing_source_directory_is_named(two_nodes, tmp_path):
    from megatron_rl.rollout.weight_fanout import fan_out

    _, head, worker = two_nodes
    with pytest.raises(Exception, match="does not exist on the source node"):
        asyncio.run(fan_out(str(tmp_path / "absent"), head, [worker]))


def test_the_copies_are_removed_on_the_other_node_at_the_end(two_nodes, tmp_path):
    from megatron_rl.rollout.weight_fanout import remove_on_nodes

    _, head, worker = two_nodes
    root = tmp_path / "megatron_rl-0-123"  # default_sync_dir's per-process dir
    (root / "weights").mkdir(parents=True)
    (root / "weights" / "model.safetensors").write_bytes(b"x" * 1000)
    (root / ".weights.fanout-tmp").mkdir()  # left by a fan-out cut short
    remove_on_nodes(str(root / "weights"), [worker])
    assert not root.exists()

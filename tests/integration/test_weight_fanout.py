"""Weights reach engines on other nodes, on a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: two raylets, each its own node id and object store).

* Files: a weight-sync directory is copied from the head node to the worker node through the
  object store. Both "nodes" share this machine's filesystem, so the copy lands on the same path
  as the source: the test checks that the write ran on the other node (the directory was
  replaced: new inode), that every byte is identical, and that no temp or old directory is left.
* Tensors (the default sync): trainer ranks on the head node push into one engine on the head
  node (their shared-memory rings) and one on the worker node (the gloo push group, wired by
  Ray node id, not by host name) in the same push; both then match transformers' logprobs.
"""
from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def two_nodes():
    import ray

    from tests.helpers.ray_dirs import local_ray_cluster

    node = {"num_cpus": 1, "object_store_memory": 96 << 20}
    with local_ray_cluster(node, [node]) as cluster:
        (worker,) = cluster.worker_nodes
        yield ray, ray.get_runtime_context().get_node_id(), worker.node_id


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_directory_is_copied_to_the_other_node_whole(two_nodes, tmp_path):
    from megatron_rl.rollout.weight_sync.fanout import fan_out, other_nodes
    from megatron_rl.rollout.weight_sync.hf_files import write_hf_weights

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
    from megatron_rl.rollout.weight_sync.fanout import fan_out

    _, head, worker = two_nodes
    with pytest.raises(Exception, match="does not exist on the source node"):
        asyncio.run(fan_out(str(tmp_path / "absent"), head, [worker]))


def test_the_copies_are_removed_on_the_other_node_at_the_end(two_nodes, tmp_path):
    from megatron_rl.rollout.weight_sync.fanout import remove_on_nodes

    _, head, worker = two_nodes
    root = tmp_path / "megatron_rl-0-123"  # default_sync_dir's per-process dir
    (root / "weights").mkdir(parents=True)
    (root / "weights" / "model.safetensors").write_bytes(b"x" * 1000)
    (root / ".weights.fanout-tmp").mkdir()  # left by a fan-out cut short
    remove_on_nodes(str(root / "weights"), [worker])
    assert not root.exists()


def test_a_tensor_push_reaches_an_engine_on_each_node(two_nodes, tmp_path, tmp_path_factory):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.model.tiny import build_tiny_qwen2
    from megatron_rl.rollout.driver.engine_pool import EnginePool
    from megatron_rl.rollout.driver.ray_engine import RayEngineClient
    from megatron_rl.rollout.weight_sync.push.protocol import LOCAL, NET
    from megatron_rl.rollout.weight_sync.push.transport import PushOptions, TensorTransport
    from tests.helpers.engine_checks import PROMPT, hf_logprobs
    from tests.helpers.engine_io import generate
    from tests.helpers.push_writer import RayTrainer

    ray, head, worker = two_nodes
    start = build_tiny_qwen2(tmp_path / "start", seed=5, num_layers=2)
    pushed = build_tiny_qwen2(tmp_path / "pushed", seed=6, num_layers=2)
    cfg = RolloutConfig(max_num_seqs=4, cpu_kv_cache_gib=0.125)

    def on(node):
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}

    engines = [RayEngineClient.create(str(start), cfg, 0, 256, actor_options=on(n), start_timeout_s=None)
               for n in (head, worker)]
    ray.get([e.actor.ready.remote() for e in engines], timeout=600)
    pool = EnginePool(engines)
    trainer = RayTrainer(pushed, tp=2, actor_options=on(head))
    try:
        push = TensorTransport(trainer, str(tmp_path / "w"), "float32",
                               PushOptions(trainer=(2, 1, 1), hf_path=str(pushed), bucket_bytes=32 << 10,
                                           timeout_s=60.0))

        async def main():
            assert [n for _, n in await pool.weight_receivers()] == [head, worker]
            figures = await push.load(pool, 4)
            spec = push._setup.spec
            from megatron_rl.rollout.engine import GenerationRequest

            requests = [GenerationRequest(f"r{i}", PROMPT, max_tokens=12, seed=i) for i in range(4)]
            out = await generate(pool, requests)
            per_engine = (await pool.stats()).extra["per_engine"]
            return figures, spec, out, [e.extra["generation_tokens"] for e in per_engine]

        figures, spec, out, tokens_per_engine = asyncio.run(main())
        assert spec.wiring == [[LOCAL, NET], [LOCAL, NET]]
        # Each trainer rank packed its share once and sent it again over gloo to the worker node.
        assert figures["push_net_mb"] == pytest.approx(figures["push_mb"], rel=1e-6)
        assert figures["push_replicas"] == 2.0
        for completion in out.values():
            assert completion.weight_version == 4
            expected = hf_logprobs(pushed, list(completion.token_ids))
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
        assert len(out) == 4
        assert all(n > 0 for n in tokens_per_engine), tokens_per_engine  # both engines generated
    finally:
        trainer.shutdown()
        asyncio.run(pool.shutdown())

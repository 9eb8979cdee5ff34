"""The weight-sync cost model the simulator charges (``planning.weight_sync_cost``): phases add up
for the file formats, the tensor push is its slowest link, and each term moves with the link it
names; the 32B recipe's files cost tens of seconds per step, its tensor push about one."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import resolve_shape
from megatron_rl.planning.weight_sync_cost import SyncAssumptions, sync_seconds

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml"


@pytest.fixture(scope="module")
def recipe():
    cfg = load_config(RECIPE)
    return cfg, resolve_shape(cfg.model.hf_path)


def test_file_phases_add_up_and_the_push_is_its_slowest_link(recipe):
    cfg, shape = recipe
    for fmt in ("sharded", "hf"):
        phases = sync_seconds(cfg, shape, fmt)
        assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"))
        assert phases["fan_out"] > 0  # 8 nodes: the directory goes to 7 others
    push = sync_seconds(cfg, shape, "tensor")
    links = max(push["trainer_send"], push["engine_receive"], push["nvlink_read"])
    assert push["total"] == pytest.approx(links + push["load"])
    bf16_gb = shape.total_params * 2 / 1e9
    assert bf16_gb == pytest.approx(65.5, rel=0.01)
    # 32 TP-2 replicas over 8 nodes: each engine GPU takes its half over the network for 7/8 of it.
    assert push["engine_receive"] == pytest.approx(bf16_gb / 2 * 7 / 8 / 40.0)
    assert 20 < sync_seconds(cfg, shape, "sharded")["total"] < sync_seconds(cfg, shape, "hf")["total"]
    assert push["total"] < 2.0


def test_each_term_follows_its_link(recipe):
    cfg, shape = recipe
    base = SyncAssumptions()
    fast_net = sync_seconds(cfg, shape, "tensor", replace(base, net_gb_s=80.0))
    assert fast_net["engine_receive"] == pytest.approx(sync_seconds(cfg, shape, "tensor")["engine_receive"] / 2)
    slow_fanout = sync_seconds(cfg, shape, "sharded", replace(base, fanout_gb_s=2.5))
    assert slow_fanout["fan_out"] == pytest.approx(2 * sync_seconds(cfg, shape, "sharded")["fan_out"])


def test_one_node_has_no_fan_out_and_no_network_push(recipe):
    cfg, shape = recipe
    one = load_config(RECIPE, ["cluster.num_nodes=1", "rollout.num_engines=4"])
    assert sync_seconds(one, shape, "sharded")["fan_out"] == 0.0
    push = sync_seconds(one, shape, "tensor")
    assert push["engine_receive"] == 0.0 and push["trainer_send"] == 0.0 and push["nvlink_read"] > 0
    with pytest.raises(ValueError, match="unknown format 'nccl'"):
        sync_seconds(cfg, shape, "nccl")


def test_the_simulator_charges_the_recipes_format(recipe):
    from megatron_rl.planning.memory import GPUS
    from rollpacker.simulator.costs import TrainModel

    cfg, shape = recipe
    tensor = TrainModel.from_recipe(cfg, shape, GPUS["h800"])
    files = TrainModel.from_recipe(cfg, shape, GPUS["h800"], sync_format="sharded")
    assert tensor.sync_s == pytest.approx(sync_seconds(cfg, shape, cfg.rollout.weight_sync_format)["total"])
    assert files.sync_s == pytest.approx(sync_seconds(cfg, shape, "sharded")["total"]) and files.sync_s > tensor.sync_s

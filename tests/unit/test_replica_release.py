"""Which engines the stream trainer releases: their GPUs must be exactly whole data-parallel replicas of the
trainer (megatron_rl.distributed.replica_release), on the layouts of the GPU recipes, with Megatron's rank
order (tp-cp-dp-pp) deciding where a replica's ranks are."""
from __future__ import annotations

import pytest

from megatron_rl.distributed.gpu_layout import gpu_layout
from megatron_rl.distributed.replica_release import (
    ReleaseError,
    choose_release,
    releasable_counts,
    release_units,
    replica_ranks,
)
from megatron_rl.planning.placement import trainer_coords


def _units(tp, cp, dp, pp, engines, rollout_tp, nodes, per_node, split=False):
    layout = gpu_layout(tp * cp * dp * pp, engines, rollout_tp, nodes, per_node, split=split)
    return release_units(layout, replica_ranks(tp, cp, dp, pp)), layout


def test_replica_ranks_follow_megatrons_rank_order():
    from megatron_rl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size = 2, 2
    cfg.parallel.data_parallel_size, cfg.parallel.pipeline_model_parallel_size = 3, 2
    replicas = replica_ranks(2, 2, 3, 2)
    assert sorted(r for ranks in replicas for r in ranks) == list(range(24))
    for dp, ranks in enumerate(replicas):
        assert {trainer_coords(r, cfg)[2] for r in ranks} == {dp} and len(ranks) == 2 * 2 * 2


def test_7b_layout_frees_a_replica_per_two_tp1_engines_and_refuses_one_naming_the_key():
    units, _ = _units(2, 1, 8, 1, engines=16, rollout_tp=1, nodes=2, per_node=8)
    assert [(u.engines, u.replicas) for u in units] == [((2 * d, 2 * d + 1), (d,)) for d in range(8)]
    assert releasable_counts(units, 16) == [2, 4, 6, 8, 10, 12, 14]
    with pytest.raises(ReleaseError, match=r"stream\.release_engines=1: .*the smallest is 2"):
        choose_release(units, 1, 16)
    chosen = choose_release(units, 4, 16)
    assert [u.engines for u in chosen] == [(12, 13), (14, 15)]  # the highest: replica 0 (rank 0's) keeps generating
    # Less to migrate wins: engines 0-3 hold nothing.
    load = [0, 0, 0, 0] + [5] * 12
    assert [u.replicas for u in choose_release(units, 4, 16, load)] == [(0,), (1,)]


def test_a_larger_rollout_tp_engine_frees_a_whole_replica_alone():
    units, _ = _units(2, 1, 8, 1, engines=8, rollout_tp=2, nodes=2, per_node=8)  # the planner's TP 2
    assert [(u.engines, u.replicas) for u in units] == [((d,), (d,)) for d in range(8)]
    assert releasable_counts(units, 8) == list(range(1, 8))


def test_pipeline_stages_spread_a_replica_over_both_halves_of_the_gpus():
    # TP2 PP2 DP4 on 16 GPUs: stage 0 holds ranks 0-7, stage 1 ranks 8-15 (Megatron's order).
    units, _ = _units(2, 1, 4, 2, engines=16, rollout_tp=1, nodes=2, per_node=8)
    assert units[0].gpus == (0, 1, 8, 9) and units[0].replicas == (0,) and len(units[0].engines) == 4
    # TP4 engines cover two stage-0 halves (GPUs 0-3) or two stage-1 halves (8-11): a unit needs both.
    units, _ = _units(2, 1, 4, 2, engines=4, rollout_tp=4, nodes=2, per_node=8)
    assert [(u.engines, u.replicas) for u in units] == [((0, 2), (0, 1)), ((1, 3), (2, 3))]
    with pytest.raises(ReleaseError, match="the smallest is 2"):
        choose_release(units, 1, 4)


def test_32b_layout_needs_a_whole_node_of_tp2_engines_per_replica():
    units, _ = _units(8, 1, 8, 1, engines=32, rollout_tp=2, nodes=8, per_node=8)
    assert all(len(u.engines) == 4 and len(u.replicas) == 1 for u in units) and len(units) == 8
    assert units[3].gpus == tuple(range(24, 32))


def test_split_placement_has_nothing_to_free():
    units, _ = _units(2, 1, 4, 1, engines=8, rollout_tp=1, nodes=2, per_node=8, split=True)
    assert units == []
    with pytest.raises(ReleaseError, match="no engine shares its GPUs"):
        choose_release(units, 1, 8)


def test_an_engine_on_gpus_without_a_trainer_rank_frees_no_replica():
    # 4 trainer ranks (DP4) on GPUs 0-3, 8 engines on GPUs 0-7: engines 4-7 free nothing.
    units, _ = _units(1, 1, 4, 1, engines=8, rollout_tp=1, nodes=1, per_node=8)
    assert [u.engines for u in units] == [(0,), (1,), (2,), (3,)]
    # TP2 engines: engine 1 covers GPUs 2, 3 (replicas 2, 3); engines 2 and 3 cover no rank.
    units, _ = _units(1, 1, 4, 1, engines=4, rollout_tp=2, nodes=1, per_node=8)
    assert [(u.engines, u.replicas) for u in units] == [((0,), (0, 1)), ((1,), (2, 3))]

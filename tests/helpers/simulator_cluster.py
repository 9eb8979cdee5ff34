"""A small simulated cluster (4 engines of a 64-sequence engine model, a fixed-cost trainer and
math rewards) for the simulator's unit tests."""
from __future__ import annotations

from dataclasses import replace

from rollpacker.simulator.costs import RewardModel, TrainModel
from rollpacker.simulator.engine_model import EngineModel
from rollpacker.simulator.policies import Cluster

MODEL = EngineModel(step_s=0.01, per_seq_s=0.001, per_ctx_token_s=1e-5, prefill_token_s=1e-4,
                    kv_capacity_tokens=10_000, max_num_seqs=4)
"""A small engine model (4 sequences, 10k KV tokens); ``small_cluster`` widens it."""


def small_cluster(lengths, engines=4) -> Cluster:
    """``engines`` engines of ``MODEL`` (200k KV tokens, 64 sequences each) serving ``lengths``."""
    train = TrainModel(10**9, 8, 1024, 4, 1e15, fixed_s=0.5, sync_s=0.2, s_per_token=1e-5)
    return Cluster(engines, 8, lambda tp: replace(MODEL, kv_capacity_tokens=200_000, max_num_seqs=64, tp=tp, gpus=tp),
                   1, 4, train, RewardModel.math(4), lengths, 16, 4, engines)

"""The production update path (MegatronWorker + compute_policy_loss, TP=2) moves the policy the
right way: responses with positive advantage become more likely, negative ones less likely."""
from __future__ import annotations

import functools

import pytest

from tests.helpers.megatron_cases import make_samples, run_spmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def _update_direction(rank: int, world: int, port: int, model_dir: str, samples):
    from megatron_rl.algorithms.losses import compute_policy_loss
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.distributed.cpu_shim import apply_cpu_shim
    from megatron_rl.training.megatron_worker import MegatronWorker

    apply_cpu_shim()
    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.optimizer.lr = 1e-3
    cfg.algorithm.clip_low = cfg.algorithm.clip_high = 0.2
    cfg.algorithm.recompute_old_logprobs = True  # the step is given its old logprobs
    worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
    try:
        worker.load_hf(model_dir)
        before = worker.compute_logprobs(samples)
        for s, lp in zip(samples, before):
            s.old_logprobs = lp
        metrics = worker.train_step(samples, functools.partial(compute_policy_loss, cfg=cfg.algorithm))
        after = worker.compute_logprobs(samples)
        return before, after, metrics
    finally:
        worker.shutdown()


def test_positive_advantage_responses_gain_probability(tiny_model_dir, tmp_path):
    samples = make_samples(8, seed=3)
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 == 0 else -1.0
    before, after, metrics = run_spmd(_update_direction, 2, (str(tiny_model_dir), samples), tmp_path, 540)[0]
    delta = [sum(a) - sum(b) for a, b in zip(after, before)]
    assert metrics["grad_norm"] > 0
    for i, d in enumerate(delta):
        if i % 2 == 0:
            assert d > 0, f"positive-advantage response {i}: sequence logprob fell by {-d}"
        else:
            assert d < 0, f"negative-advantage response {i}: sequence logprob rose by {d}"

"""GPU tier (skipped without CUDA): the Megatron worker on NCCL/CUDA matches transformers.

Never run in this project's CI (no GPU there); kept so a cluster user can check a node with
`bash tests/run.sh tests/gpu`.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.megatron_cases import hf_reference, make_samples, run_spmd

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _cuda_logprobs(rank: int, world: int, port: int, model_dir: str, samples):
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.training.megatron_worker import MegatronWorker

    torch.cuda.set_device(rank)
    cfg = RunConfig()
    cfg.cluster.device = "cuda"
    cfg.parallel.tensor_model_parallel_size = world
    worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
    try:
        worker.load_hf(model_dir)
        off_gpu = [n for n, p in worker.model.named_parameters() if p.device.type != "cuda"]
        assert not off_gpu, f"parameters left off the GPU: {off_gpu}"
        return worker.compute_logprobs(samples)
    finally:
        worker.shutdown()


def test_cuda_logprobs_match_transformers(tiny_model_dir, tmp_path):
    world = min(2, torch.cuda.device_count())
    samples = make_samples(6, seed=5)
    expected, _, _ = hf_reference(str(tiny_model_dir), samples)
    got = run_spmd(_cuda_logprobs, world, (str(tiny_model_dir), samples), tmp_path, 540, fresh=True)[0]  # CUDA
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)

"""The GPU check's per-part set-up (tests/gpu/check/common.prepare_process), on this CPU box.

The first H200 run of the check failed three bit-for-bit comparisons (recompute, offload,
distributed optimizer) because ``warn_only=True`` let cuDNN attention's nondeterministic backward
run. These tests pin the set-up that a deterministic GPU part now gets, with CUDA faked only where
the set-up touches the device (``set_device``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.check.common import Context, prepare_process


@pytest.fixture
def restore_torch_state():
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn, mem = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    flash, math = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.backends.cuda.enable_mem_efficient_sdp(mem)
    torch.backends.cuda.enable_flash_sdp(flash)
    torch.backends.cuda.enable_math_sdp(math)
    torch.set_num_threads(threads)


def _fake_cuda(monkeypatch) -> list[int]:
    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    return devices


def test_gpu_deterministic_part_errors_on_nondeterministic_kernels(monkeypatch, restore_torch_state, tmp_path: Path):
    devices = _fake_cuda(monkeypatch)
    prepare_process(Context("gpu", tmp_path), deterministic=True)
    assert devices == [0]
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only ran cuDNN's backward anyway
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    # attention keeps a backend: flash (deterministic backward when warn_only is off) and math
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_gpu_timing_part_keeps_every_attention_backend(monkeypatch, restore_torch_state, tmp_path: Path):
    _fake_cuda(monkeypatch)
    torch.use_deterministic_algorithms(False)
    prepare_process(Context("gpu", tmp_path), deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_cpu_deterministic_part_warns_only(restore_torch_state, tmp_path: Path):
    prepare_process(Context("cpu", tmp_path), deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.get_num_threads() == 1

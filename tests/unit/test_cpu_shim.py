"""The CUDA->CPU shim, exercised in a subprocess (it patches torch.cuda process-wide)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op with a GPU")
def test_shim_redirects_cuda_calls_to_cpu() -> None:
    code = textwrap.dedent("""
        import threading, torch
        torch.set_num_threads(1)
        from megatron_rl.distributed.cpu_shim import apply_cpu_shim, cpu_device_mode
        assert apply_cpu_shim() and apply_cpu_shim()  # idempotent
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.current_stream().wait_stream(None)
        torch.cuda.manual_seed(3); a = torch.rand(2)
        state = torch.cuda.get_rng_state(); b = torch.rand(2)
        torch.cuda.set_rng_state(state); assert torch.equal(torch.rand(2), b)
        torch.manual_seed(3); assert torch.equal(torch.rand(2), a)
        with cpu_device_mode():
            t = torch.zeros(3, device="cuda")
            u = torch.ones(2, device=torch.cuda.current_device()).cuda().to("cuda")
            assert t.device.type == "cpu" and u.device.type == "cpu"
        try:
            torch.zeros(1, device="cuda")
        except (RuntimeError, AssertionError):
            pass
        else:
            raise SystemExit("device rewrite leaked outside the mode")
        errors = []
        def other_thread():  # the mode is thread-local: entering it per thread is required
            try:
                with cpu_device_mode():
                    torch.empty(1, device="cuda:0")
            except Exception as exc:
                errors.append(exc)
        th = threading.Thread(target=other_thread); th.start(); th.join()
        assert not errors, errors
        from megatron.core.optimizer import clip_grads
        p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-6)
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]

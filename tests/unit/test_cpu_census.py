"""tests/helpers/cpu_census: a command's processes and their CPU, by kind."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cpu_census import kind_of

# It idles after spinning so that a sample taken late on a loaded box still sees all of its CPU.
SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5:\n    pass\ntime.sleep(1.0)\n"


def test_a_child_that_spins_is_counted_with_its_kind(tmp_path):
    out = tmp_path / "census.jsonl"
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    run = subprocess.run([sys.executable, "-m", "tests.helpers.cpu_census", "--period", "0.2", "--out", str(out), "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    spun = [r for r in rows if r["kind"] == "python spin.py"]
    assert len(spun) == 1 and 1.2 <= spun[0]["spent"] <= 3.0, spun
    assert "python spin.py" in run.stderr and "CPU s" in run.stderr


def test_kinds_follow_ray_and_vllm_titles_and_python_modules():
    assert kind_of("ray::TrainerRan", "ray::TrainerRank.call") == "ray::TrainerRank"
    assert kind_of("VLLM::EngineCor", "VLLM::EngineCore") == "VLLM::EngineCore"
    assert kind_of("python", "/x/.venv/bin/python -u -m megatron_rl.train a=b") == "python -m megatron_rl.train"
    assert kind_of("python", "/x/bin/python /x/ray/_private/log_monitor.py --x") == "python log_monitor.py"
    assert kind_of("raylet", "/x/raylet --raylet_socket_name=/tmp/r") == "raylet"

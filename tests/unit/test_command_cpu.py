"""megatron_rl.benchmarks.profiling.command_cpu: processes sorted into the table's kinds, and a real
command sampled (its CPU found in its own row, its exit code passed on)."""
from __future__ import annotations

import json
import sys

from megatron_rl.benchmarks.profiling.command_cpu import KINDS, Seen, kind_of, main, markdown, table


def test_loop_roles_and_command_lines_get_their_kinds():
    assert kind_of("engine core", "VLLM::EngineCor", "VLLM::EngineCore") == KINDS["engine core"]
    assert kind_of("trainer rank", "ray::TrainerRan", "ray::TrainerRank") == KINDS["trainer rank"]
    assert kind_of("ray runtime", "raylet", "/x/raylet --head") == KINDS["ray runtime"]
    assert kind_of("other", "python", "/v/bin/python -m megatron_rl.train model.hf_path=m").startswith("driver")
    assert kind_of("other", "python", "python -c from megatron_rl.reward.sandbox.isolated_call import "
                   "_fork_server_main; _fork_server_main(5, '')").startswith("reward grading")
    assert kind_of("other", "python", "/v/bin/python -m pytest -q tests").startswith("pytest")
    assert kind_of("other", "python3.11", "/v/bin/python -c from multiprocessing.spawn import spawn_main") \
        .startswith("other Python")
    assert kind_of("other", "bash", "bash tests/run.sh").startswith("other (shells")


def test_table_sums_per_kind_and_sorts_by_cpu():
    seen = [Seen(1, "a", 3.0, 10), Seen(2, "a", 1.0, 30), Seen(3, "b", 6.0, 4)]
    rows = table(seen)
    assert [r["kind"] for r in rows] == ["b", "a"]
    a = rows[1]
    assert (a["processes"], a["cpu_s"], a["share"], a["cpu_s_each"]) == (2, 4.0, 0.4, 2.0)
    assert (a["threads_median"], a["threads_max"]) == (20, 30)
    text = markdown(rows)
    assert "| b | 1 | 6 | 60 % | 6.0 | 4 / 4 |" in text and "| all | 3 | 10 |" in text


def test_a_real_command_is_sampled_and_its_exit_code_passed_on(tmp_path, capsys):
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass\nraise SystemExit(3)"
    out = tmp_path / "cpu.json"
    rc = main(["--interval", "0.1", "--out", str(out), "--", sys.executable, "-c", busy])
    assert rc == 3
    report = json.loads(out.read_text())
    assert report["exit_code"] == 3
    python_rows = [r for r in report["rows"] if r["kind"].startswith("other Python")]
    assert python_rows and python_rows[0]["cpu_s"] >= 0.5, report["rows"]
    assert "| other Python" in capsys.readouterr().out


ORPHAN = """import os, sys, time
if os.fork() == 0:
    if os.fork() == 0:  # the grandchild outlives its parent: no longer a descendant of the command
        t = time.process_time()
        while time.process_time() - t < 0.8: pass
        os._exit(0)
    os._exit(0)
os.wait()
time.sleep(2.0)
"""


def test_host_mode_finds_processes_that_left_the_command_tree(tmp_path):
    """``--host`` samples every process started after the command (Ray nodes started by ``ray start``
    and Slurm's steps are not its descendants): a double-forked busy grandchild is counted."""
    report = {}
    for host in (False, True):
        out = tmp_path / f"cpu_{host}.json"
        rc = main(["--interval", "0.1", "--out", str(out), *(["--host"] if host else []), "--",
                   sys.executable, "-c", ORPHAN])
        assert rc == 0
        rows = json.loads(out.read_text())["rows"]
        report[host] = sum(r["cpu_s"] for r in rows if r["kind"].startswith("other Python"))
    assert report[True] >= report[False] + 0.5, report


EXEC_LATER = """import os, sys, time  # pytest: this command line reads as pytest's
if os.fork() == 0:
    time.sleep(1.0)  # sampled meanwhile with its parent's command line
    os.execv(sys.executable, [sys.executable, "-c",
             "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.8: pass"])
os.wait()
"""


def test_a_child_that_execs_another_python_program_is_counted_as_that_program(tmp_path):
    """A process seen before its exec has its parent's command line, and ``python`` stays its name:
    its CPU goes to what it ran after the exec (here other Python, not pytest)."""
    out = tmp_path / "cpu.json"
    assert main(["--interval", "0.1", "--out", str(out), "--", sys.executable, "-c", EXEC_LATER]) == 0
    rows = json.loads(out.read_text())["rows"]
    cpu = {kind: sum(r["cpu_s"] for r in rows if r["kind"].startswith(kind)) for kind in ("other Python", "pytest")}
    assert cpu["other Python"] >= 0.5 and cpu["pytest"] < 0.5, rows
    processes = json.loads(out.read_text())["processes"]
    assert [p["cpu_s"] for p in processes] == sorted((p["cpu_s"] for p in processes), reverse=True)
    child = processes[0]  # the busiest: the exec'd loop, under its own command line and parent
    assert "process_time() - t < 0.8" in child["cmdline"] and child["cpu_s"] >= 0.5, processes
    parent = next(p for p in processes if p["pid"] == child["ppid"])
    assert "os.execv" in parent["cmdline"]
    assert 0 <= parent["start_s"] <= child["start_s"] <= child["last_s"], processes


RENAMED_FORK = """
import ctypes, os, time
def name(title):
    ctypes.CDLL(None).prctl(15, title.encode(), 0, 0, 0)  # PR_SET_NAME, as vLLM's titles set it
name("VLLM::EngineCore")
if os.fork() == 0:
    time.sleep(0.5)  # seen under the parent's name first
    name("VLLM::Worker_TP0")
    t = time.process_time()
    while time.process_time() - t < 0.8:
        pass
    os._exit(0)
os.wait()
if os.fork() == 0:
    name("ray::EngineActor")
    time.sleep(0.3)
    t = time.process_time()
    while time.process_time() - t < 0.8:
        pass
    name("ray::IDLE")  # Ray renames an actor's process as it ends
    time.sleep(0.5)
    os._exit(0)
os.wait()
"""


def test_a_forked_child_that_takes_its_own_name_is_counted_under_it(tmp_path):
    """A TP worker forked from an engine core carries the core's name until it sets its own: its
    CPU goes to the TP-worker row, not the engine core's. An engine actor renamed as it ends
    stays in the front-end row."""
    out = tmp_path / "cpu.json"
    assert main(["--interval", "0.1", "--out", str(out), "--", sys.executable, "-c", RENAMED_FORK]) == 0
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[KINDS["engine worker"]]["cpu_s"] >= 0.5, rows
    assert rows.get(KINDS["engine core"], {"cpu_s": 0.0})["cpu_s"] < 0.5, rows
    assert rows[KINDS["engine front-end"]]["cpu_s"] >= 0.5, rows

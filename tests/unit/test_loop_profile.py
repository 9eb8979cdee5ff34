"""The loop profiler's attribution (megatron_rl/benchmarks/profiling): phases from phases.jsonl, CPU split at
phase boundaries, py-spy Chrome traces turned into intervals, idle and category rules, the flame
graph, and a real py-spy recording of a process whose work is known."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.benchmarks.profiling import attribution as att
from megatron_rl.benchmarks.profiling.flamegraph import flame_svg


def _phases_file(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "phases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_phases_are_labelled_by_round_type_and_the_gaps_are_between(tmp_path):
    _phases_file(tmp_path, [
        {"step": 0, "round_type": "short", "phases": [["rollout", 10.0, 12.0], ["logprob", 12.0, 12.5],
                                                       ["train", 12.5, 14.0]]},
        {"step": 1, "round_type": "long", "phases": [["rollout", 14.5, 18.0], ["weight_sync", 18.0, 18.5]]},
    ])
    phases = att.read_phases(tmp_path)
    assert [p.label for p in phases] == ["rollout/short", "scoring", "train", "rollout/long", "weight_sync"]
    wall = att.phase_wall(phases)
    assert wall["rollout/long"] == pytest.approx(3.5)
    assert wall[att.BETWEEN] == pytest.approx(0.5)  # 14.0 -> 14.5
    assert att.loop_window(phases) == (10.0, 18.5)


def test_cpu_is_split_at_phase_boundaries_and_nothing_outside_the_window_counts():
    phases = [att.Phase(0, "short", "rollout/short", 1.0, 2.0), att.Phase(0, "short", "train", 2.0, 3.0)]
    # 1 CPU-second per second from t=0 to t=4, sampled every 0.5 s: only [1, 3] is in the window.
    samples = [(t / 2, t / 2) for t in range(9)]
    cpu = att.phase_cpu(samples, phases)
    assert cpu["rollout/short"] == pytest.approx(1.0)
    assert cpu["train"] == pytest.approx(1.0)
    assert sum(cpu.values()) == pytest.approx(2.0)
    # A sample interval straddling a boundary is spread evenly over it.
    into: dict[str, float] = {}
    att.split_by_phase(1.5, 2.5, 1.0, phases, (1.0, 3.0), into)
    assert into == {"rollout/short": pytest.approx(0.5), "train": pytest.approx(0.5)}


def _trace(path: Path, events: list[tuple[str, str, int]], tid: int = 7) -> Path:
    path.write_text(json.dumps([{"ph": ph, "name": name, "ts": ts, "tid": tid, "pid": 1, "args": {}}
                                for ph, name, ts in events]))
    return path


def test_chrome_trace_becomes_stack_intervals_on_the_monotonic_clock(tmp_path):
    trace = _trace(tmp_path / "t.json", [
        ("B", 'process 1:"x"', 0), ("B", "<module> (a.py)", 0), ("B", "work (a.py)", 0),
        ("E", "work (a.py)", 2_000_000), ("B", "Event.wait (threading.py)", 2_000_000),
        ("E", "Event.wait (threading.py)", 3_000_000), ("E", "<module> (a.py)", 3_000_000),
    ])
    intervals = att.spy_intervals(trace, started=100.0)
    assert intervals[7] == [(100.0, 102.0, ("<module> (a.py)", "work (a.py)")),
                            (102.0, 103.0, ("<module> (a.py)", "Event.wait (threading.py)"))]
    assert att.main_thread(intervals) == 7
    assert not att.is_idle(intervals[7][0][2]) and att.is_idle(intervals[7][1][2])


def test_kernel_cpu_is_shared_among_the_active_stacks_of_each_window():
    phases = [att.Phase(0, "long", "rollout/long", 0.0, 4.0)]
    intervals = [(0.0, 2.0, ("<module>", "GPUModelRunner._model_forward (x)")),
                 (2.0, 3.0, ("<module>", "SpecDrafter.propose (x)")),
                 (3.0, 4.0, ("<module>", "Poller.poll (zmq)"))]  # idle: no CPU expected, none given
    samples = [(0.0, 0.0), (2.0, 2.0), (3.0, 3.0), (4.0, 3.2)]
    cats = att.attribute_cpu(samples, intervals, "engine core", phases)["rollout/long"]
    assert cats["model forward"] == pytest.approx(2.0)
    assert cats["drafting (proposer)"] == pytest.approx(1.0)
    assert cats["unattributed"] == pytest.approx(0.2)  # CPU while py-spy saw only the idle stack


def test_categories_follow_the_rules_of_each_role():
    assert att.category("engine core", ("x", "EngineCore.step", "Scheduler.schedule (s.py)")) == "scheduling"
    # mp executor: the core waits for its worker inside sample_tokens; the spin rule wins.
    assert att.category("engine core", ("MultiprocExecutor.sample_tokens (m.py)", "FutureWrapper.result (m.py)",
                                        "SpinCondition.wait (shm.py)", "sched_yield (u.py)")).startswith("spin-wait")
    assert att.category("engine worker", ("GPUModelRunner.sample_tokens", "RejectionSampler.forward")) \
        == "verification (rejection sampling)"
    assert att.category("trainer rank", ("forward_backward_no_pipelining (s.py)", "backward_step (s.py)")) == "backward"
    assert att.category("trainer rank", ("MegatronWorker.compute_logprobs (w.py)", "forward_step (s.py)")) \
        == "scoring (old-logprob forward)"
    assert att.category("reward worker", ("nothing known",)) == "other"


def test_flame_graph_boxes_are_as_wide_as_their_time():
    svg = flame_svg({("main", "a"): 3.0, ("main", "b"): 1.0}, "demo")
    assert svg.startswith("<svg") and "demo" in svg
    assert 'width="900.0"' in svg and 'width="300.0"' in svg  # a: 3/4 of 1200 px, b: 1/4
    assert "a: 3.00 s (75.0 %)" in svg


@pytest.mark.skipif(shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists(),
                    reason="py-spy not installed (requirements/cpu.lock has it)")
def test_a_real_recording_attributes_a_known_workload(tmp_path, monkeypatch):
    """py-spy on a child that computes in one function for 1.2 CPU s (CPU time, so a busy box
    stretches the wall time, not the figure), then sleeps ~1 s in another:
    the kernel's CPU lands on the computing function; the sleeping one, blocked in C below a
    Python frame py-spy cannot tell from work, gets (almost) none, because its windows had none."""
    from megatron_rl.benchmarks.profiling.sampling import ProcessRecord, SpyRecorders

    monkeypatch.setitem(att.CATEGORIES, "test", [("crunch", ("crunch",)), ("rest", ("rest",))])
    script = tmp_path / "work.py"
    script.write_text("import time\n"
                      "def crunch():\n    t = time.process_time()\n    while time.process_time() - t < 1.2: sum(range(500))\n"
                      "def rest():\n    time.sleep(1.0)\n"
                      "time.sleep(0.5)\ncrunch()\nrest()\n")
    child = subprocess.Popen([sys.executable, str(script)])
    spy = SpyRecorders(tmp_path / "spy", rate=50)
    spy.attach(ProcessRecord(pid=child.pid, ppid=os.getpid(), role="driver", name="python", cmdline="", env={},
                             first_seen=time.monotonic()))
    samples = []
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            break
        samples.append((time.monotonic(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")))
        time.sleep(0.05)
    started, trace = spy.stop()[child.pid]
    intervals = att.spy_intervals(trace, started)
    thread = intervals[att.main_thread(intervals)]
    window = [att.Phase(0, "x", "all", samples[0][0], samples[-1][0])]
    cats = att.attribute_cpu(samples, thread, "test", window)["all"]
    assert cats.get("crunch", 0.0) == pytest.approx(1.2, abs=0.4)
    assert cats.get("rest", 0.0) < 0.15

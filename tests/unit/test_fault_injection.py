"""Fault points (megatron_rl/runtime/fault_injection.py): the spec, inertness, once-per-run firing across
processes, and each action on real processes (no mocks: a child Python process arms a point from
its environment and is killed or stopped by it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_rl.runtime import fault_injection as fi


@pytest.fixture
def armed(monkeypatch, tmp_path):
    """Arm faults in this process: ``armed("point=...,action=raise")``; disarmed afterwards."""

    def arm(spec: str):
        monkeypatch.setenv(fi.FAULTS_ENV, spec)
        monkeypatch.setenv(fi.FAULTS_DIR_ENV, str(tmp_path))
        fi.reload()
        return tmp_path

    yield arm
    monkeypatch.delenv(fi.FAULTS_ENV, raising=False)
    fi.reload()


def test_the_spec_is_parsed_with_its_filters():
    faults = fi.parse(" point=train.backward,step=2,rank=1,action=kill ; point=checkpoint.commit,action=stop;")
    assert faults == [fi.Fault(0, "train.backward", "kill", 2, 1), fi.Fault(1, "checkpoint.commit", "stop")]
    assert faults[0].matches(2, 1) and not faults[0].matches(2, 0) and not faults[0].matches(3, 1)
    assert faults[1].matches(7, None) and faults[1].matches(None, 3)


@pytest.mark.parametrize("spec, words", [
    ("point=train.forward,action=kill", "unknown point 'train.forward'"),
    ("point=train.backward,action=explode", "action must be one of"),
    ("point=train.backward,action=kill,step=two", "integers"),
    ("point=train.backward,action=kill,when=now", "'when=now'"),
    ("point=train.backward", "action must be one of"),
])
def test_a_bad_spec_is_refused_naming_the_entry(spec, words):
    with pytest.raises(fi.FaultSpecError, match=words):
        fi.parse(spec)


def test_armed_faults_need_a_record_directory(monkeypatch):
    monkeypatch.setenv(fi.FAULTS_ENV, "point=train.backward,action=raise")
    monkeypatch.delenv(fi.FAULTS_DIR_ENV, raising=False)
    with pytest.raises(fi.FaultSpecError, match=fi.FAULTS_DIR_ENV):
        fi.reload()
    monkeypatch.delenv(fi.FAULTS_ENV)
    fi.reload()


def test_unarmed_points_do_nothing():
    assert fi._ARMED == {}
    fi.fault_point("train.backward", step=0, rank=0)  # no spec, no directory: returns at once


def test_a_fault_fires_once_at_its_step_and_rank_and_records_where(armed):
    records = armed("point=checkpoint.save,step=3,rank=1,action=raise")
    fi.fault_point("checkpoint.save", step=3, rank=0)  # another rank
    fi.fault_point("checkpoint.save", step=2, rank=1)  # another step
    fi.fault_point("checkpoint.commit", step=3, rank=1)  # another point
    with pytest.raises(fi.FaultInjected, match=r"raise at checkpoint.save, step=3, rank=1"):
        fi.fault_point("checkpoint.save", step=3, rank=1)
    fi.fault_point("checkpoint.save", step=3, rank=1)  # once per run: already fired
    [record] = [json.loads(p.read_text()) for p in records.iterdir()]
    assert record["point"] == "checkpoint.save" and record["step"] == 3 and record["rank"] == 1
    assert record["pid"] == os.getpid() and abs(record["time"] - time.time()) < 60


def test_the_backward_point_fires_inside_the_backward_pass(armed):
    import torch

    armed("point=train.backward,step=5,rank=0,action=raise")
    x = torch.ones(3, requires_grad=True)
    out = (x * 2).sum()
    fi.fault_point_in_backward(out, "train.backward", step=4, rank=0)  # another step: no hook
    out.backward(retain_graph=True)
    fi.fault_point_in_backward(out, "train.backward", step=5, rank=0)
    with pytest.raises(fi.FaultInjected):
        out.backward()


CHILD = """
import sys, time
from megatron_rl.runtime.fault_injection import fault_point
print("ready", flush=True)
fault_point("weight_push.send", step=int(sys.argv[1]), rank=0)
print("continued", flush=True)
"""


def _child(tmp_path, spec: str, step: int) -> subprocess.Popen:
    env = dict(os.environ, **{fi.FAULTS_ENV: spec, fi.FAULTS_DIR_ENV: str(tmp_path)})
    return subprocess.Popen([sys.executable, "-c", CHILD, str(step)], env=env, stdout=subprocess.PIPE, text=True)


def test_kill_kills_the_process_at_the_point_and_a_second_process_does_not_fire_it(tmp_path):
    spec = "point=weight_push.send,step=1,action=kill"
    first = _child(tmp_path, spec, 1)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL and out.split() == ["ready"]
    second = _child(tmp_path, spec, 1)  # e.g. a replacement: the fault is spent
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0 and out.split() == ["ready", "continued"]
    assert json.loads((tmp_path / "fault0-weight_push.send.json").read_text())["pid"] == first.pid


def test_stop_stalls_the_process_until_it_is_continued(tmp_path):
    child = _child(tmp_path, "point=weight_push.send,action=stop", 0)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the point did not stop the process"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and out.split() == ["continued"]
    finally:
        if child.poll() is None:
            child.kill()


def test_a_part_named_by_the_call_site_is_what_dies(armed):
    armed("point=engine.submit,step=2,action=kill")
    victim = subprocess.Popen(["sleep", "60"])
    fi.fault_point("engine.submit", step=2, part=lambda: [victim.pid])  # this process lives on
    assert victim.wait(timeout=30) == -signal.SIGKILL

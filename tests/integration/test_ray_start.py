"""A local Ray node whose raylet misses Ray's fixed 30 s registration wait is stopped and started
again (``megatron_rl.distributed.ray_start``); other start-up errors are not retried.

The slow raylet is real: a thread in the driver stops the first attempt's raylet with SIGSTOP as
soon as it appears (what a busy host does to it, for longer), so Ray's own wait runs out and
raises. Each case runs in a subprocess, so the test process never holds a half-started node.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.ray_dirs import short_ray_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

DRIVER = textwrap.dedent('''
    import gc, json, logging, os, signal, sys, threading, time
    import psutil, ray
    from megatron_rl.distributed.ray_start import init_local_ray
    from megatron_rl.distributed.local_state import pid_alive

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # The collector off: the failed attempt's Popen objects are never collected, so nothing waits
    # on its killed processes and they stay zombies (as they do until the collector happens to run).
    gc.disable()
    stopped = []

    def stop_first_raylet():
        while not stopped:
            for p in psutil.Process().children(recursive=True):
                try:
                    if p.name() == "raylet":
                        os.kill(p.pid, signal.SIGSTOP)
                        stopped.append(p.pid)
                        return
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.05)

    threading.Thread(target=stop_first_raylet, daemon=True).start()
    t0 = time.monotonic()
    init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
    started_s = time.monotonic() - t0
    node_ok = ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
    # Running ones: a killed child nobody waited on yet stays in the table as a zombie.
    raylets = [p.pid for p in psutil.Process().children(recursive=True)
               if p.name() == "raylet" and p.status() != psutil.STATUS_ZOMBIE]
    ray.shutdown()
    print(json.dumps({"stopped": stopped, "stopped_alive": [pid_alive(p) for p in stopped],
                      "raylets": raylets, "node_ok": node_ok, "started_s": started_s}))
''')


def test_a_raylet_that_misses_the_start_up_wait_is_replaced_and_the_node_starts():
    with short_ray_dir() as temp:
        proc = subprocess.run([sys.executable, "-c", DRIVER, str(temp)], capture_output=True, text=True,
                              timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["stopped"]) == 1, out
    assert "did not register within Ray's fixed 30 s start-up wait (attempt 1 of 3" in proc.stderr
    # The first attempt's raylet (stopped, so it would never have finished) was killed, not left
    # running beside the second node's.
    assert out["stopped_alive"] == [False], out
    assert out["stopped"][0] not in out["raylets"] and len(out["raylets"]) == 1, out
    assert out["node_ok"] and out["started_s"] >= 30, out


def test_errors_other_than_the_start_up_wait_are_not_retried():
    driver = textwrap.dedent('''
        import logging, sys
        from megatron_rl.distributed.ray_start import init_local_ray
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        try:
            init_local_ray(num_cpus=-1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
        except ValueError as exc:
            print("raised:", exc)
    ''')
    with short_ray_dir() as temp:
        proc = subprocess.run([sys.executable, "-c", driver, str(temp)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "raised: Resource quantities must be nonnegative" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "start-up wait" not in proc.stderr

"""slurm_local.JobSegments: the psm_* segments a job's processes map (the Slurm test's leak check)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.slurm_local import JobSegments

CHILD = """
import sys, time
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(create=True, size=4096, name=sys.argv[1])
print("mapped", flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_segment_the_jobs_process_maps_is_seen_and_another_process_s_is_not():
    job_id = 900000 + os.getpid() % 90000
    mine, other = f"psm_jobseg_{os.getpid()}", f"psm_other_{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, name], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, **({"SLURM_JOB_ID": str(job_id)} if name == mine else {})))
             for name in (mine, other)]
    try:
        with JobSegments(job_id, period=0.2) as watch:
            for proc in procs:
                assert proc.stdout.readline().strip() == "mapped"
            time.sleep(0.6)
        assert mine in watch.seen and other not in watch.seen, watch.seen
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        for name in (mine, other):
            Path("/dev/shm", name).unlink(missing_ok=True)

"""What a sandbox run is given and what it gives back: the job kinds, the limits, the result, and
the names of the isolation layers a plan applies.

The leaf of :mod:`megatron_rl.reward.sandbox`: both :mod:`~megatron_rl.reward.sandbox.sandbox`
(which chooses the plan) and :mod:`~megatron_rl.reward.sandbox.supervisor` (which runs it) use
these, and neither imports the other's private names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

JOB_KINDS = ("asserts", "pytest", "stdio")
"""``job['kind']`` values (see :meth:`~megatron_rl.reward.sandbox.sandbox.Sandbox.run`)."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox run."""

    wall_s: float = 10.0
    """Wall-clock limit of the whole run (both interpreters' start-up included)."""
    cpu_s: float = 10.0
    """CPU-time limit of each process (RLIMIT_CPU; the kernel kills the program when it is used up)."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) in MiB of each process."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE) in MiB."""
    disk_mb: int = 64
    """Most MiB the program may write in total (all files in the sandbox directory)."""
    output_bytes: int = 1 << 20
    """Most bytes of stdout + stderr kept; a program printing more is killed. Also the cap of
    what one stdin/stdout case may print."""
    nproc: int = 512
    """RLIMIT_NPROC: processes + threads of the run's real uid (enforced for a non-root uid)."""


@dataclass
class SandboxResult:
    """Outcome of one sandbox run."""

    status: str
    """'passed', 'failed', 'timeout', 'output_limit' (stdout/stderr over ``output_bytes`` or
    files over ``disk_mb``), 'error' (the sandbox itself failed) or 'cancelled'."""
    cases_passed: int = 0
    """Test cases (an asserts program = 1 case, test functions, stdio cases) that passed."""
    cases_total: int = 0
    """Test cases run or planned."""
    detail: str = ""
    """First failure, the limit hit, or the error."""
    elapsed_s: float = 0.0
    """Wall-clock seconds of the run."""
    returncode: int | None = None
    """Exit status of the solution process (negative: killed by that signal)."""
    stdout: str = ""
    """What the solution printed (at most ``output_bytes``)."""
    stderr: str = ""
    """The solution's stderr (at most ``output_bytes``)."""
    isolation: list[str] = field(default_factory=list)
    """Layers that were active (see :attr:`Sandbox.layers`)."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def layer_names(plan: dict) -> list[str]:
    """The isolation layers every run under ``plan`` gets (see ``Sandbox.layers``), outermost first."""
    return (plan["ns"] + (["private_root"] if plan["root"] else []) + ["rlimits"]
            + (["uid_drop"] if plan["uid"] else []) + plan["kernel"] + ["audit_hook"]
            + ([] if plan["root"] else ["disk_poll"]))


def check_job(job: dict) -> None:
    """Raise ValueError when ``job`` lacks what its kind needs."""
    kind = job.get("kind")
    if kind not in JOB_KINDS:
        raise ValueError(f"sandbox job kind {kind!r}: expected one of {JOB_KINDS}")
    needed = ("solution", "cases") if kind == "stdio" else ("solution", "tests")
    for key in needed:
        if key not in job:
            raise ValueError(f"sandbox job of kind {kind!r} needs {key!r}")
    if kind == "stdio" and not all(isinstance(c, (list, tuple)) and len(c) == 2 and all(isinstance(x, str) for x in c)
                                   for c in job["cases"]):
        raise ValueError("sandbox job 'cases' must be [stdin, expected stdout] string pairs")

"""The code sandbox contains hostile programs, keeps its verdict out of their reach, and passes
correct ones (standard library included)."""
from __future__ import annotations

import os
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.reward.sandbox.job import SandboxLimits
from megatron_rl.reward.sandbox.sandbox import Sandbox, namespace_prefix

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=3.0, memory_mb=512, file_mb=1, disk_mb=8, output_bytes=64 << 10)
MODES = {"auto": dict(isolation="auto"), "audit": dict(isolation="audit"),
         "hook_only": dict(isolation="audit", kernel_filters=False)}


@pytest.fixture(scope="module", params=list(MODES))
def sandbox(request) -> Sandbox:
    """Every case runs with the best isolation available here, without namespaces, and with the
    audit hook as the only layer inside the process."""
    return Sandbox(**MODES[request.param])


def run(sandbox: Sandbox, solution: str, tests: str = "assert True", limits: SandboxLimits = LIMITS, **job):
    return sandbox.run({"kind": "asserts", "solution": textwrap.dedent(solution), "tests": textwrap.dedent(tests),
                        **job}, limits)


def test_correct_solution_passes_and_wrong_one_fails(sandbox: Sandbox) -> None:
    ok = run(sandbox, """
        def add(a, b):
            return a + b
        print("hello")
    """, "assert add(2, 3) == 5")
    assert ok.status == "passed" and ok.passed, ok.detail
    assert (ok.cases_passed, ok.cases_total) == (1, 1)
    assert ok.stdout == "hello"
    assert "rlimits" in ok.isolation and "audit_hook" in ok.isolation
    bad = run(sandbox, "def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5, 'wrong sum'")
    assert bad.status == "failed"
    assert "AssertionError: wrong sum" in bad.detail


def test_standard_library_that_inspects_frames_works(sandbox: Sandbox) -> None:
    """typing, namedtuple, dataclasses, functional Enum, logging, traceback, fractions, decimal,
    statistics all look at frames (sys._getframe / tb_frame); the old audit hook refused it."""
    result = run(sandbox, """
        from typing import Dict, List, NamedTuple, Optional
        import collections, dataclasses, decimal, enum, fractions, logging, statistics, traceback

        P = collections.namedtuple("P", "x y")
        class Q(NamedTuple):
            a: int
        @dataclasses.dataclass(frozen=True)
        class D:
            x: int
            tags: Optional[List[str]] = None
        E = enum.Enum("E", "A B")
        logging.warning("to stderr")
        try:
            1 / 0
        except ZeroDivisionError:
            TB = traceback.format_exc()

        def summary(xs: List[int]) -> Dict[str, object]:
            return {"mean": statistics.mean(xs), "third": fractions.Fraction(1, 3), "dec": decimal.Decimal("1.10"),
                    "p": P(1, 2), "q": Q(3)}
    """, """
        r = summary([1, 2, 3])
        assert r["mean"] == 2 and r["third"] == fractions.Fraction(1, 3) and r["dec"] == decimal.Decimal("1.10")
        assert r["p"] == (1, 2) and r["p"].y == 2 and r["q"].a == 3
        assert D(1) == D(1) and D(1) != D(2)
        assert E.A is E["A"] and E(2) is E.B
        assert "ZeroDivisionError" in TB
    """)
    assert result.status == "passed", result.detail
    assert "to stderr" in result.stderr


def test_fork_bomb_and_new_processes_are_refused(sandbox: Sandbox) -> None:
    result = run(sandbox, "import os\nwhile True:\n    os.fork()\n")
    assert result.status == "failed"
    assert "not allowed" in result.detail or "not permitted" in result.detail, result.detail
    for program in ("import subprocess\nsubprocess.run(['true'])", "import multiprocessing",
                    "import os\nos.system('true')", "import _posixsubprocess",
                    "import os\nos.execv('/bin/true', ['true'])",
                    "import os\nos.posix_spawn('/bin/true', ['true'], {})"):
        assert run(sandbox, program).status == "failed", program


def test_infinite_loop_is_killed_at_the_wall_limit(sandbox: Sandbox) -> None:
    limits = SandboxLimits(wall_s=1.0, cpu_s=5.0)
    result = run(sandbox, "def f():\n    while True:\n        pass\n", "f()", limits)
    assert result.status == "timeout", result.detail
    assert 0.9 <= result.elapsed_s < 10.0  # generous: the machine may be loaded
    sleeper = run(sandbox, "import time\ntime.sleep(100)\n", limits=limits)
    assert sleeper.status == "timeout" and sleeper.elapsed_s < 10.0, sleeper.detail


def test_cpu_limit_kills_a_busy_program(sandbox: Sandbox) -> None:
    # A generous wall limit: on a loaded machine 1 CPU second can take several wall seconds.
    result = run(sandbox, "while True:\n    pass\n", limits=SandboxLimits(wall_s=120.0, cpu_s=1.0))
    assert result.status == "timeout", (result.detail, result.returncode, result.stderr[-300:])
    assert "CPU limit" in result.detail, result.detail
    assert result.elapsed_s < 120.0


def test_huge_output_is_cut_and_the_program_killed(sandbox: Sandbox) -> None:
    result = run(sandbox, "while True:\n    print('x' * 1000)\n")
    assert result.status == "output_limit"
    assert result.elapsed_s < 5.0
    assert len(result.stdout) <= LIMITS.output_bytes
    big_file = run(sandbox, "open('big.bin', 'wb').write(b'x' * (2 << 20))\n")  # over file_mb=1
    assert big_file.status == "failed"
    assert "File too large" in big_file.detail or "file size" in big_file.detail, big_file.detail


def test_total_disk_use_is_limited(sandbox: Sandbox) -> None:
    """RLIMIT_FSIZE bounds one file; many files under it must not add up past disk_mb."""
    result = run(sandbox, """
        for i in range(160):
            with open(f"part{i}.bin", "wb") as f:
                f.write(b"x" * (1000 << 10))
    """)
    assert result.status in ("failed", "output_limit"), result.detail
    assert "No space left" in result.detail or "files over" in result.detail, result.detail
    small = run(sandbox, "open('a.bin', 'wb').write(b'x' * (512 << 10))\nSIZE = len(open('a.bin', 'rb').read())\n",
                "assert SIZE == 512 << 10")
    assert small.status == "passed", small.detail


def test_memory_limit(sandbox: Sandbox) -> None:
    result = run(sandbox, "x = bytearray(2 << 30)\n")
    assert result.status == "failed"
    assert "MemoryError" in result.detail


def test_secrets_outside_the_sandbox_cannot_be_read(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-TOKEN")
    repo_file = Path(__file__).resolve()
    home_file = Path(os.path.expanduser("~")) / ".bashrc"
    for target in (secret, repo_file, home_file, Path("/etc/passwd"), Path("/etc/shadow")):
        result = run(sandbox, f"print(open({str(target)!r}).read())\n")
        assert result.status == "failed", target
        assert "not allowed" in result.detail or "No such file" in result.detail or \
            "Permission denied" in result.detail, result.detail
        assert "TOP-SECRET" not in result.stdout and "root:" not in result.stdout
    listing = run(sandbox, f"import os\nprint(os.listdir({str(tmp_path)!r}))\n")
    assert listing.status == "failed" and "secret.txt" not in listing.stdout
    # A symlink planted inside the sandbox does not lead out of it.
    link = run(sandbox, f"import os\nos.symlink({str(secret)!r}, 'l')\nprint(open('l').read())\n")
    assert link.status == "failed" and "TOP-SECRET" not in link.stdout
    # The environment is scrubbed: HOME is the sandbox directory, no inherited variables.
    env = run(sandbox, "import os\nKEYS = sorted(os.environ)\nHOME_OK = os.environ['HOME'] == os.getcwd()\n",
              "assert set(KEYS) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'PYTHONHASHSEED', 'PYTHONIOENCODING',"
              " 'LC_CTYPE'}, KEYS\n"
              "assert HOME_OK")
    assert env.status == "passed", env.detail


def test_patching_os_path_does_not_open_the_audit_hook(sandbox: Sandbox) -> None:
    """The hook resolves paths with functions it captured, so faking realpath/lstat in the
    program does not make an outside file look inside."""
    result = run(sandbox, """
        import os, posixpath
        here = os.getcwd()
        os.path.realpath = posixpath.realpath = lambda p, **k: here + "/x"
        os.lstat = lambda p: os.stat(here)
        print(open("/etc/passwd").read())
    """)
    assert result.status == "failed" and "root:" not in result.stdout


def test_writes_stay_inside_the_sandbox_directory(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "pwned.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
                    f"open('../{target.name}', 'w').write('x')",
                    f"import os\nos.remove({str(Path(__file__).resolve())!r})",
                    f"import os\nos.rename('x', {str(target)!r})"):
        result = run(sandbox, program)
        assert result.status == "failed", program
    assert not target.exists()
    assert Path(__file__).exists()
    inside = run(sandbox, "open('scratch.txt', 'w').write('ok')\nDATA = open('scratch.txt').read()\n",
                 "assert DATA == 'ok'")
    assert inside.status == "passed", inside.detail


def test_sockets_are_refused(sandbox: Sandbox) -> None:
    for program in ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
                    "import _socket\n_socket.socket()",
                    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')",
                    "import ctypes\nctypes.CDLL(None).socket(2, 1, 0)"):
        result = run(sandbox, program)
        assert result.status == "failed", program
        assert "not allowed" in result.detail, (program, result.detail)


def test_network_namespace_when_available() -> None:
    sandbox = Sandbox(isolation="auto")
    if "netns" not in sandbox.layers:
        pytest.skip("unshare --net is not available here")
    assert {"pidns", "mntns", "private_root"} <= set(sandbox.layers)
    # /proc/net/dev lists the interfaces of the reader's network namespace: only the (down) loopback.
    prefix, _ = namespace_prefix()
    out = subprocess.run(prefix + ["cat", "/proc/net/dev"], capture_output=True, text=True, timeout=20)
    interfaces = [line.split(":")[0].strip() for line in out.stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    # In the private root the host's files are absent, not just forbidden.
    paths = [p for p in ("/etc/passwd", str(Path(__file__).resolve()), os.path.expanduser("~/.bashrc"),
                         os.path.expanduser("~/.ssh"), "/etc/hostname") if os.path.exists(p)]
    seen = run(sandbox, f"import os\nSEEN = [p for p in {paths!r} if os.path.exists(p)]\n", "assert SEEN == [], SEEN")
    assert seen.status == "passed", seen.detail


def test_modes_on_a_box_without_namespaces(monkeypatch) -> None:
    """'namespaces' refuses to start, 'auto' falls back to the in-process layers (which still
    keep the host's files out), and the disk limit becomes the polling one."""
    from megatron_rl.reward.sandbox import sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "_probe_cache", {"ns": ([], [])})  # as if unshare did not work
    with pytest.raises(RuntimeError, match="namespaces"):
        Sandbox(isolation="namespaces")
    auto = Sandbox(isolation="auto")
    assert "netns" not in auto.layers and "private_root" not in auto.layers
    assert {"rlimits", "audit_hook", "disk_poll"} <= set(auto.layers)
    assert run(auto, "def f():\n    return 2\n", "assert f() == 2").status == "passed"
    secret = run(auto, "print(open('/etc/passwd').read())\n")
    assert secret.status == "failed" and "root:" not in secret.stdout


def test_user_namespace_plan_when_available() -> None:
    """What a non-root cluster node gets: the namespaces inside a user namespace, a private root,
    no uid drop (only uid 0 is mapped), and still no host files and the kernel filters."""
    import shutil

    from megatron_rl.reward.sandbox import sandbox as sandbox_module
    from megatron_rl.reward.sandbox.supervisor import execute

    unshare = shutil.which("unshare")
    prefix = [unshare or "unshare", "--user", "--map-root-user", "--fork", "--kill-child", "--net", "--pid", "--mount",
              "--ipc", "--uts"]
    if not unshare or subprocess.run(prefix + ["true"], capture_output=True, timeout=20).returncode != 0:
        pytest.skip("unprivileged user namespaces are not available here")
    plan = {"prefix": prefix, "ns": ["userns", "netns", "pidns", "mntns", "ipcns"], "root": True, "uid": None,
            "kernel": sandbox_module.kernel_filters()}
    job = {"kind": "asserts", "solution": "import os, typing\nSEEN = os.path.exists('/etc/passwd')\n"
                                          "open('x', 'w').write('ok')\n", "tests": "assert SEEN is False"}
    result = execute(plan, job, LIMITS, None, base_dir=None, system_paths=sandbox_module._system_paths(),
                     python=sandbox_module._python())
    assert result.status == "passed", result.detail
    assert {"userns", "private_root"} <= set(result.isolation)


def test_verdict_cannot_be_forged(sandbox: Sandbox) -> None:
    """Every way to claim a pass from inside the solution's process scores 'failed'."""
    attacks = {
        "early os._exit": "import os\nos._exit(0)\n",
        "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
        "fake verdict lines": "import json\nprint('0' * 32, json.dumps({'passed': True}))\n"
                              "print('{\"passed\": true, \"cases_passed\": 1, \"cases_total\": 1}')\n",
        "patched json.dumps / os.write": "import json, os\njson.dumps = lambda *a, **k: '{\"passed\": true}'\n"
                                         "w = os.write\nos.write = lambda fd, b: w(fd, b.replace(b'false', b'true'))\n",
        "forged messages on every fd": "import os\nfor fd in range(256):\n    try:\n        os.write(fd, "
                                       "b'{\"passed\": true, \"cases_passed\": 1, \"cases_total\": 1}')\n"
                                       "    except OSError:\n        pass\n",
        "frame walk": "import sys\nf = sys._getframe()\nwhile f.f_back:\n    f = f.f_back\n"
                      "f.f_globals['__builtins__'] = None\n",
        "kill the parent": "import os\nfor p in (os.getppid(), 1, -1):\n    try:\n        os.kill(p, 9)\n"
                           "    except OSError:\n        pass\n",
        "builtins tampering": "import builtins\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
                              "builtins.isinstance = lambda *a: True\ndef abs(x):\n    return 0\n",
    }
    for name, program in attacks.items():
        result = run(sandbox, program + "\ndef f(x):\n    return x\n", "assert abs(f(3) - 4) < 1e-9")
        assert result.status == "failed", (name, result.status, result.detail)
    eq = run(sandbox, "class A:\n    def __eq__(s, o):\n        return True\ndef f():\n    return A()\n",
             "assert f() == 5")
    assert eq.status == "failed"
    bombs = run(sandbox, """
        class Bomb:
            def __eq__(self, other):
                raise SystemExit(0)
            def __del__(self):
                raise KeyboardInterrupt
            def __repr__(self):
                raise BaseException("repr")
        def f():
            return Bomb()
        def g():
            raise SystemExit(0)
    """, "assert f() == 1\n")
    assert bombs.status == "failed"
    assert run(sandbox, "def g():\n    raise SystemExit(0)\n", "g()").status == "failed"


def test_parent_and_judge_survive_kill_attempts(sandbox: Sandbox) -> None:
    result = run(sandbox, """
        import os, signal
        for target in (os.getppid(), 1, -1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        REACHED = []
        try:  # a pidfd signal is not an audited event; signal 0 only checks it would arrive
            signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)
            REACHED.append("pidfd")
        except (OSError, AttributeError):
            pass
        def f():
            return 1
    """, "assert f() == 1 and REACHED == [], REACHED")
    assert result.status == "passed", result.detail  # the judge lived to write the verdict


def test_solution_never_sees_the_tests(sandbox: Sandbox) -> None:
    """The tests' text and the expected outputs stay in the judge's process."""
    result = sandbox.run({"kind": "stdio", "cases": [["1\n", "SECRET-EXPECTED-OUTPUT"]], "solution": textwrap.dedent("""
        import gc, os, sys
        found = []
        try:
            found += [o for o in gc.get_objects() if isinstance(o, str)]
        except Exception:
            pass
        for name, module in list(sys.modules.items()):
            found += [v for v in vars(module).values() if isinstance(v, str) and "SECRET-EXPECTED" in v]
        for root in ("/proc/self/fd", ".", "/tmp"):
            try:
                entries = os.listdir(root)
            except OSError:
                continue
            for entry in entries:
                try:
                    found.append(open(os.path.join(root, entry)).read())
                except Exception:
                    pass
        print([x for x in found if "SECRET-EXPECTED" in x])
    """)}, LIMITS)
    assert result.status == "failed" and "got '[]" in result.detail, result.detail


def test_in_place_changes_and_objects_cross_the_wire(sandbox: Sandbox) -> None:
    result = run(sandbox, """
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
            def __len__(self):
                return len(self.items)
        def rotate(matrix):
            matrix[:] = [list(r) for r in zip(*matrix[::-1])]
        def apply(fn, xs):
            return [fn(x) for x in xs]
        def count(n):
            yield from range(n)
        class Oops(ValueError):
            pass
        def fail():
            raise Oops("nope")
    """, """
        s = Stack(); s.push(1); s.push(2)
        assert len(s) == 2 and s.pop() == 2 and s.items == [1]
        m = [[1, 2], [3, 4]]; row = m[0]
        rotate(m)
        assert m == [[3, 1], [4, 2]]
        assert apply(lambda v: v * 2, [1, 2]) == [2, 4] and apply(len, ["abc"]) == [3]
        assert list(count(3)) == [0, 1, 2]
        try:
            fail()
        except ValueError as e:
            assert isinstance(e, Oops) and str(e) == "nope"
        else:
            raise AssertionError("no exception")
        assert 2 ** 5000 == (lambda: 2 ** 5000)() and apply(lambda b: b, [b"\\x00\\xff"]) == [b"\\x00\\xff"]
    """)
    assert result.status == "passed", result.detail


def test_stdio_and_pytest_jobs(sandbox: Sandbox) -> None:
    stdio = sandbox.run({"kind": "stdio", "solution": "a, b = map(int, input().split())\nprint(a + b)\n",
                         "cases": [["1 2\n", "3"], ["5 5", "10\n"]]}, LIMITS)
    assert (stdio.status, stdio.cases_passed, stdio.cases_total) == ("passed", 2, 2)
    wrong = sandbox.run({"kind": "stdio", "solution": "print(input())\n", "cases": [["1", "1"], ["2", "3"]]}, LIMITS)
    assert (wrong.status, wrong.cases_passed) == ("failed", 1)
    assert "case 1" in wrong.detail
    raw = sandbox.run({"kind": "stdio", "solution": "import sys\nprint(sum(map(int, open(0).read().split())))\n",
                       "cases": [["1 2 3", "6"], ["4", "4"]]}, LIMITS)
    assert raw.status == "passed", raw.detail
    tests = textwrap.dedent("""
        import pytest
        from solution import div

        @pytest.fixture
        def two():
            yield 2

        def test_div(two):
            assert div(6, 3) == pytest.approx(two)

        @pytest.mark.parametrize("a, b", [(1, 1), pytest.param(4, 2)])
        def test_param(a, b):
            assert div(a, b) * b == a

        def test_raises():
            with pytest.raises(ZeroDivisionError):
                div(1, 0)

        def test_prints(capsys):
            div(1, 1)
            assert capsys.readouterr().out == "dividing\\n"
    """)
    job = {"kind": "pytest", "solution": "def div(a, b):\n    print('dividing')\n    return a / b\n", "tests": tests}
    result = sandbox.run(job, LIMITS)
    assert (result.status, result.cases_passed, result.cases_total) == ("passed", 5, 5), result.detail
    job["solution"] = "def div(a, b):\n    return a * b\n"
    assert sandbox.run(job, LIMITS).status == "failed"
    # Test functions the solution defines itself are not collected.
    job["solution"] = "def div(a, b):\n    return 0\ndef test_fake():\n    pass\n"
    job["tests"] = "from solution import *\n\ndef test_div():\n    assert div(4, 2) == 2\n"
    assert sandbox.run(job, LIMITS).status == "failed"


def test_cancel_stops_a_running_program(sandbox: Sandbox) -> None:
    job = {"kind": "asserts", "solution": "import time\ntime.sleep(30)\n", "tests": "assert True"}
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    start = time.monotonic()
    result = sandbox.run(job, SandboxLimits(wall_s=30.0, cpu_s=30.0), cancel)
    timer.join()
    assert result.status == "cancelled", result.detail
    assert time.monotonic() - start < 10.0
    assert sandbox.run(job, LIMITS, cancel).status == "cancelled"  # already set: never starts


def test_throwaway_directories_are_removed(tmp_path: Path) -> None:
    sandbox = Sandbox(base_dir=str(tmp_path))
    result = run(sandbox, "import os\nopen('f', 'w').write('x')\nprint(os.getcwd())\n")
    assert result.status == "passed", result.detail
    assert Path(result.stdout).parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_bad_isolation_mode_and_bad_jobs() -> None:
    with pytest.raises(ValueError, match="sandbox_isolation"):
        Sandbox(isolation="chroot")
    sandbox = Sandbox()
    with pytest.raises(ValueError, match="'tests'"):
        sandbox.run({"kind": "asserts", "solution": "x = 1"}, LIMITS)
    with pytest.raises(ValueError, match="kind"):
        sandbox.run({"kind": "program", "solution": "x = 1"}, LIMITS)
    with pytest.raises(ValueError, match="cases"):
        sandbox.run({"kind": "stdio", "solution": "x = 1", "cases": [["only stdin"]]}, LIMITS)

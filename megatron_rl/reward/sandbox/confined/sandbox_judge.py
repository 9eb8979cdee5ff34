"""The judge process of a sandbox run: runs the dataset's tests and writes the verdict.

Started by :mod:`megatron_rl.reward.sandbox.supervisor` next to the solution process
(``python -I -S -B -c "...; main()"``), with its job (the tests, the expected outputs) on stdin.
No untrusted code ever runs here: the solution is reached only through
:class:`sandbox_remote.Remote`, whose answers are plain data decoded here or opaque proxies. The verdict goes to a pipe that only this
process holds (the solution process never gets that descriptor, and on the kernel layers cannot
reach this process: another PID namespace, another landlock domain, no ptrace, no signals), and
the parent takes a pass only from there.

Kinds:

* ``asserts`` (HumanEval ``check(candidate)``, MBPP assert lists, plain assert programs): the
  optional setup code, then the tests, run as one module whose missing globals resolve to the
  solution's (see :class:`sandbox_remote.LiveNamespace`). One case.
* ``pytest`` (KodCode): the test module imports ``solution`` (a :class:`RemoteModule`) and
  ``pytest`` (:mod:`sandbox_pytest`); every ``test*`` function and ``Test*`` class method is a
  case (parametrize, fixtures, ``capsys``). Stops at the first failure.
* ``stdio``: the solution's program is run once per case on that stdin, in its process; the
  expected output never leaves this one; outputs are compared token by token.
"""
import builtins
import itertools
import marshal
import os
import sys
import types


def _error(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - str() of a test's own exception failed
        return type(exc).__name__


def _verdict(passed: bool, done: int, total: int, error: str = "") -> dict:
    return {"passed": passed, "cases_passed": done, "cases_total": total, "error": error[:500]}


class Judge:
    def __init__(self, job: dict, remote, pytest_shim, remote_module) -> None:
        self.job, self.remote, self.pytest, self.remote_module = job, remote, pytest_shim, remote_module

    def run(self) -> dict:
        kind = self.job["kind"]
        total = len(self.job.get("cases", ())) if kind == "stdio" else 1
        try:
            hello = self.remote.ask("load")
            if type(hello) is not dict or type(hello.get("ok")) is not bool:
                self.remote.fail("bad load answer")
            if not hello["ok"]:
                error = hello.get("error")
                return _verdict(False, 0, total, error if type(error) is str else "the solution failed to load")
            names = hello.get("names")
            if type(names) is not list or not all(type(n) is str for n in names):
                self.remote.fail("bad name list")
            verdict = getattr(self, f"run_{kind}")(names)
        except BaseException as exc:  # noqa: BLE001 - SolutionGone, or a broken test file
            verdict = _verdict(False, 0, total, _error(exc))
        if self.remote.broken:
            verdict = dict(verdict, passed=False, error=self.remote.broken[:500])
        return verdict

    # ------------------------------------------------------------------ asserts
    def run_asserts(self, names: list[str]) -> dict:
        namespace = self.remote_module.LiveNamespace(self.remote, names, self.job.get("entry_point", ""))
        namespace.update(__name__="__main__", __builtins__=builtins)
        try:
            if self.job.get("setup"):
                exec(compile(self.job["setup"], "setup.py", "exec"), namespace)
            exec(compile(self.job["tests"], "tests.py", "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - any failure fails the case
            return _verdict(False, 0, 1, _error(exc))
        return _verdict(True, 1, 1)

    # ------------------------------------------------------------------ stdio
    def run_stdio(self, names: list[str]) -> dict:
        cases = self.job["cases"]
        for i, (stdin, expected) in enumerate(cases):
            answer = self.remote.ask("stdio", **{"in": stdin})
            if type(answer) is not dict or type(answer.get("out")) is not str or \
                    not (answer.get("err") is None or type(answer.get("err")) is str):
                self.remote.fail("bad stdio answer")
            if answer["err"]:
                return _verdict(False, i, len(cases), f"case {i}: {answer['err']}")
            if answer["out"].split() != expected.split():
                return _verdict(False, i, len(cases),
                                f"case {i}: expected {expected[:80]!r}, got {answer['out'][:80]!r}")
        return _verdict(True, len(cases), len(cases))

    # ------------------------------------------------------------------ pytest
    def run_pytest(self, names: list[str]) -> dict:
        sys.modules["solution"] = self.remote_module.RemoteModule(self.remote, names)
        sys.modules["pytest"] = self.pytest
        namespace = {"__name__": "test_solution", "__builtins__": builtins, "__file__": "test_solution.py"}
        try:
            exec(compile(self.job["tests"], "test_solution.py", "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001
            return _verdict(False, 0, 1, f"test module: {_error(exc)}")
        fixtures = {f._sandbox_fixture["name"]: f for f in namespace.values()
                    if type(f) is types.FunctionType and "_sandbox_fixture" in f.__dict__}
        tests = list(self._collect(namespace, fixtures))
        if not tests:
            return _verdict(False, 0, 0, "no test_* functions")
        passed = 0
        for name, fn, params, owner, xfail in tests:
            try:
                self._run_one(fn, params, owner, fixtures)
            except self.pytest.Skipped:
                continue
            except BaseException as exc:  # noqa: BLE001 - any failure fails the case
                if xfail and not self.remote.broken:
                    continue
                return _verdict(False, passed, len(tests), f"{name}: {_error(exc)}")
            passed += not xfail
        if passed == 0:
            return _verdict(False, 0, 0, "every test was skipped or expected to fail")
        return _verdict(True, passed, passed)

    def _collect(self, namespace: dict, fixtures: dict):
        def marks(fn) -> dict:
            return fn.__dict__.get("_sandbox_marks") or {"parametrize": [], "skip": False, "xfail": False,
                                                        "usefixtures": []}

        def expand(name, fn, owner):
            m = marks(fn)
            if m["skip"] or (owner is not None and getattr(owner, "_sandbox_class_flag", "") == "skip"):
                return
            grids = list(m["parametrize"])
            for arg in self._argnames(fn, owner):
                spec = getattr(fixtures.get(arg), "_sandbox_fixture", None)
                if spec and spec["params"] is not None and not any(arg in row for g in grids for row in g):
                    grids.append([{("@" + arg): p} for p in spec["params"]])
            for combo in itertools.product(*grids) if grids else [()]:
                params = {}
                for row in combo:
                    params.update(row)
                yield name, fn, params, owner, m["xfail"]

        for name, obj in list(namespace.items()):
            if not isinstance(name, str):
                continue
            if name.startswith("test") and type(obj) is types.FunctionType and "_sandbox_fixture" not in obj.__dict__:
                yield from expand(name, obj, None)
            elif name.startswith("Test") and type(obj) is type:
                for attr, member in vars(obj).items():
                    if attr.startswith("test") and type(member) is types.FunctionType:
                        yield from expand(f"{name}.{attr}", member, obj)

    @staticmethod
    def _argnames(fn, owner) -> list[str]:
        code = fn.__code__
        names = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
        if owner is not None and names:
            names = names[1:]  # self
        defaults = len(fn.__defaults__ or ())
        positional = code.co_argcount - (1 if owner is not None else 0)
        required = names[:positional - defaults] + [n for n in names[positional:]
                                                   if n not in (fn.__kwdefaults__ or {})]
        return required

    def _run_one(self, fn, params: dict, owner, fixtures: dict) -> None:
        teardowns: list = []
        cache: dict = {}
        instance = owner() if owner is not None else None
        try:
            if instance is not None and hasattr(instance, "setup_method"):
                instance.setup_method(fn)
            for spec_fn in fixtures.values():
                if spec_fn._sandbox_fixture["autouse"]:
                    self._fixture(spec_fn._sandbox_fixture["name"], params, fixtures, cache, teardowns, ())
            for name in (fn.__dict__.get("_sandbox_marks") or {}).get("usefixtures", []):
                self._fixture(name, params, fixtures, cache, teardowns, ())
            kwargs = {}
            for arg in self._argnames(fn, owner):
                kwargs[arg] = params[arg] if arg in params else \
                    self._fixture(arg, params, fixtures, cache, teardowns, ())
            target = fn.__get__(instance, owner) if instance is not None else fn
            result = target(**kwargs)
            if isinstance(result, types.CoroutineType):
                result.close()
                raise RuntimeError("async tests are not supported in the sandbox")
        finally:
            for teardown in reversed(teardowns):
                teardown()
            if instance is not None and hasattr(instance, "teardown_method"):
                instance.teardown_method(fn)

    def _fixture(self, name: str, params: dict, fixtures: dict, cache: dict, teardowns: list, stack: tuple):
        if name in cache:
            return cache[name]
        if name in ("capsys", "capfd"):
            value = _Capsys(self.remote)
            self.remote.ask("capture", action="start")
            teardowns.append(lambda: self.remote.ask("capture", action="stop"))
        elif name == "request":
            value = self.pytest.FixtureRequest()
        elif name in fixtures and name not in stack:
            fn = fixtures[name]
            kwargs = {}
            for arg in self._argnames(fn, None):
                if arg == "request":
                    kwargs[arg] = self.pytest.FixtureRequest(params.get("@" + name))
                else:
                    kwargs[arg] = params[arg] if arg in params else \
                        self._fixture(arg, params, fixtures, cache, teardowns, stack + (name,))
            value = fn(**kwargs)
            if isinstance(value, types.GeneratorType):
                generator = value
                value = next(generator)
                teardowns.append(lambda: next(generator, None))
        else:
            raise LookupError(f"fixture {name!r} is not available in the sandbox")
        cache[name] = value
        return value


class _Capsys:
    """``capsys``: what the solution printed since the last read (captured in its process)."""

    def __init__(self, remote) -> None:
        self._remote = remote

    def readouterr(self):
        import collections

        answer = self._remote.ask("capture", action="read")
        if type(answer) is not dict or type(answer.get("out")) is not str or type(answer.get("err")) is not str:
            self._remote.fail("bad capture answer")
        return collections.namedtuple("CaptureResult", "out err")(answer["out"], answer["err"])

    def disabled(self):
        import contextlib

        return contextlib.nullcontext()


def main() -> None:
    import sandbox_confine
    import sandbox_pytest
    import sandbox_remote
    import sandbox_wire
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != here]
    job = marshal.loads(sys.stdin.buffer.read())  # from the parent, which is trusted
    fds = job["fds"]
    try:
        sandbox_confine.apply(job["confine"])
    except OSError as exc:
        verdict = dict(_verdict(False, 0, 0, f"judge confinement failed: {exc}"), sandbox_error=True)
    else:
        remote = sandbox_remote.Remote(fds["from_solution"], fds["to_solution"], job["max_bytes"])
        verdict = Judge(job, remote, sandbox_pytest, sandbox_remote).run()
    data = sandbox_wire.dumps(verdict).encode()
    while data:
        data = data[os.write(fds["verdict"], data):]
    os.close(fds["verdict"])
    os._exit(0)


if __name__ == "__main__":
    main()

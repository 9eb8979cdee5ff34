"""The solution process's side of the wire: load the solution, answer the judge's questions.

Runs inside the confined, audit-hooked solution process (:mod:`sandbox_child`), in the same
interpreter as the untrusted code, so nothing here is trusted by anyone: the judge treats every
answer as data of the solution's choosing (see :mod:`sandbox_judge`). Questions are small dicts
``{"op": ..., ...}``; answers are ``{"v": value}`` (plus ``"sync"``: the arguments' state after a
call, so in-place changes reach the judge's objects) or ``{"e": exception}``.
"""
import builtins
import os
import sys
import types

import sandbox_wire as wire


class JudgeObject:
    """Stands for an object of the judge's (a callback, an iterator, an instance of a test's
    class) passed as an argument; every use is a question back to the judge, which only allows
    calls, public attributes, iteration, len, indexing, truth and text."""

    __slots__ = ("_server", "_h")

    def __init__(self, server: "Server", handle: int) -> None:
        object.__setattr__(self, "_server", server)
        object.__setattr__(self, "_h", handle)

    def _ask(self, op: str, **kw):
        return self._server.ask_judge(op, self._h, **kw)

    def __call__(self, *args, **kwargs):
        return self._ask("call", a=list(args), k=kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", name=name, v=value)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self) -> int:
        return self._ask("len")

    def __getitem__(self, key):
        return self._ask("getitem", key=key)

    def __contains__(self, value) -> bool:
        return bool(self._ask("contains", v=value))

    def __bool__(self) -> bool:
        return bool(self._ask("bool"))

    def __str__(self) -> str:
        return str(self._ask("str"))

    def __repr__(self) -> str:
        return str(self._ask("repr"))


def std_ref(obj, hint: str | None = None):
    """[module, qualname] when ``obj`` is a module, class or function of an allowed standard
    library module (the judge then uses its own copy), else None."""
    if type(obj) is types.ModuleType:
        name = getattr(obj, "__name__", None)
        return [name, ""] if name in wire.STD_MODULES and sys.modules.get(name) is obj else None
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                        types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        owner = getattr(obj, "__objclass__", None)
        module = getattr(owner if owner is not None else obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if type(module) is str and type(qualname) is str and module in wire.STD_MODULES:
            try:
                if wire.std_lookup(module, qualname) is obj:
                    return [module, qualname]
            except (ImportError, AttributeError, ValueError):
                pass
    if hint and "typing" in sys.modules and getattr(sys.modules["typing"], hint, None) is obj:
        return ["typing", hint]
    return None


class Server:
    """Loads the solution and answers the judge until the judge closes the channel."""

    def __init__(self, job: dict, text_sink, sink_text) -> None:
        fds = job["fds"]
        self.channel = wire.Channel(fds["from_judge"], fds["to_judge"], self.answer, job["max_bytes"])
        self.kind, self.source, self.setup = job["kind"], job["solution"], job.get("setup", "")
        self.output_cap = job["output_cap"]
        self.text_sink, self.sink_text = text_sink, sink_text
        self.objects: list = []
        self.index: dict[int, int] = {}
        self.stubs: dict[int, JudgeObject] = {}
        self.module = self.code = self.loaded = self.capture = None
        self._hint = None
        self._sync = None
        self._methods: dict = {}

    def run(self) -> None:
        self.loaded = self.load()
        try:
            self.channel.serve()
        except wire.WireError:
            pass
        self._flush()
        os._exit(0)

    def load(self) -> dict:
        try:
            if self.kind == "stdio":
                self.code = compile(self.source, "solution.py", "exec")
                return {"ok": True, "names": []}
            module = types.ModuleType("solution")
            module.__dict__["__builtins__"] = builtins
            sys.modules["solution"] = module
            self.module = module
            if self.setup:
                exec(compile(self.setup, "setup.py", "exec"), module.__dict__)
            exec(compile(self.source, "solution.py", "exec"), module.__dict__)
        except BaseException as exc:  # noqa: BLE001 - any failure of the solution is an answer
            return {"ok": False, "error": self._text(exc)}
        finally:
            self._flush()
        return {"ok": True, "names": [n for n in list(module.__dict__) if type(n) is str and not n.startswith("__")]}

    # ------------------------------------------------------------------ answering
    def answer(self, question: dict) -> dict:
        op = question.get("op")
        handler = getattr(self, f"op_{op}", None) if type(op) is str and op.isidentifier() else None
        self._sync = None
        try:
            if handler is None:
                raise ValueError(f"unknown question {op!r}")
            value = handler(question)
            reply = {"v": wire.encode(value, self.tag)}
            if self._sync is not None:
                reply["sync"] = [[key, wire.encode(state, self.tag)] for key, state in self._sync]
        except wire.WireError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the judge
            reply = {"e": self.describe(exc)}
        finally:
            self._hint = None
            self._flush()
        return reply

    def tag(self, obj) -> dict:
        if type(obj) is JudgeObject:
            return {"J": object.__getattribute__(obj, "_h")}
        ref = std_ref(obj, self._hint)
        if ref is not None:
            return {"std": ref}
        return {"P": [self.register(obj), self.meta(obj)]}

    def register(self, obj) -> int:
        key = id(obj)
        if key not in self.index:
            self.index[key] = len(self.objects)
            self.objects.append(obj)  # kept alive, so the id stays this object's
        return self.index[key]

    def meta(self, obj):
        """What the judge needs to know about a new handle: an exception class's name and
        built-in bases; an instance's public method names (so ``obj.m(...)`` is one question)."""
        if isinstance(obj, type):
            return {"exc": [obj.__name__, self._builtin_bases(obj)]} if issubclass(obj, BaseException) else None
        cls = type(obj)
        if cls not in self._methods:
            self._methods[cls] = sorted({name for klass in cls.__mro__[:-1] for name, value in vars(klass).items()
                                         if type(name) is str and not name.startswith("_")
                                         and isinstance(value, types.FunctionType)})
        return {"m": self._methods[cls]} if self._methods[cls] else None

    @staticmethod
    def _builtin_bases(cls) -> list[str]:
        return [c.__name__ for c in cls.__mro__ if getattr(builtins, c.__name__, None) is c]

    def describe(self, exc: BaseException) -> dict:
        cls = type(exc)
        desc = {"n": cls.__name__, "b": self._builtin_bases(cls), "s": self._text(exc, with_name=False)}
        try:
            desc["a"] = wire.encode(list(exc.args), _refuse)
        except BaseException:  # noqa: BLE001 - arguments that are not plain data stay behind
            pass
        if getattr(builtins, cls.__name__, None) is not cls:
            desc["c"] = self.register(cls)
        return desc

    @staticmethod
    def _text(exc: BaseException, with_name: bool = True) -> str:
        try:
            text = str(exc)
        except BaseException:  # noqa: BLE001 - a __str__ that raises
            text = "<unprintable>"
        if type(text) is not str:
            text = "<unprintable>"
        try:
            name = type(exc).__name__
        except BaseException:  # noqa: BLE001
            name = "Exception"
        return (f"{name}: {text}" if with_name else text)[:2000]

    def _flush(self) -> None:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - the program may have replaced or closed them
                pass

    # ------------------------------------------------------------------ values
    def resolve(self, tag: str, body):
        if tag == "P":
            handle = body[0] if type(body) is list and body else body
            if type(handle) is not int or not 0 <= handle < len(self.objects):
                raise wire.WireError(f"unknown handle {handle!r}")
            return self.objects[handle]
        if tag == "J":
            if type(body) is not int:
                raise wire.WireError("bad judge handle")
            if body not in self.stubs:
                self.stubs[body] = JudgeObject(self, body)
            return self.stubs[body]
        return wire.std_lookup(*body)

    def decode(self, data):
        return wire.decode(data, self.resolve)

    def obj(self, question: dict):
        return self.resolve("P", question.get("h"))

    def ask_judge(self, op: str, handle: int, **kw):
        question = {"op": op, "h": handle}
        for key, value in kw.items():
            question[key] = wire.encode(value, self.tag)
        reply = self.channel.request(question)
        if "v" in reply:
            return self.decode(reply["v"])
        desc = reply.get("e") or {}
        name, text = desc.get("n"), desc.get("s", "")
        cls = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            cls = RuntimeError
        raise cls(text)

    # ------------------------------------------------------------------ questions
    def op_load(self, q):
        return self.loaded

    def op_get(self, q):
        name = q.get("name")
        if self.module is None or type(name) is not str or name not in self.module.__dict__:
            raise AttributeError(f"module 'solution' has no attribute {name!r}")
        self._hint = name
        return self.module.__dict__[name]

    def op_call(self, q):
        """Call a handle, or (with ``name``) one of its methods."""
        args, kwargs = self.decode(q.get("a", [])), self.decode(q.get("k", {"m": {}}))
        if type(args) is not list or type(kwargs) is not dict:
            raise wire.WireError("bad call arguments")
        target = self.obj(q)
        if "name" in q:
            target = getattr(target, q["name"])
        sync = [(key, args[key] if type(key) is int else kwargs[key]) for key in q.get("sync") or []]
        before = [_plain_copy(value) for _, value in sync]
        result = target(*args, **kwargs)
        # Send back only the arguments the call changed (most calls change none).
        self._sync = [(key, value) for (key, value), old in zip(sync, before) if not _same(value, old)]
        return result

    def op_getattr(self, q):
        return getattr(self.obj(q), q["name"])

    def op_setattr(self, q):
        setattr(self.obj(q), q["name"], self.decode(q["v"]))

    def op_delattr(self, q):
        delattr(self.obj(q), q["name"])

    def op_getitem(self, q):
        return self.obj(q)[self.decode(q["key"])]

    def op_setitem(self, q):
        self.obj(q)[self.decode(q["key"])] = self.decode(q["v"])

    def op_delitem(self, q):
        del self.obj(q)[self.decode(q["key"])]

    def op_contains(self, q):
        return self.decode(q["v"]) in self.obj(q)

    def op_len(self, q):
        return len(self.obj(q))

    def op_bool(self, q):
        return bool(self.obj(q))

    def op_str(self, q):
        return str(self.obj(q))

    def op_repr(self, q):
        return repr(self.obj(q))

    def op_iter(self, q):
        return iter(self.obj(q))

    def op_next(self, q):
        return next(self.obj(q))

    def op_isinstance(self, q):
        return isinstance(self.decode(q["v"]), self.obj(q))

    def op_issubclass(self, q):
        return issubclass(self.decode(q["v"]), self.obj(q))

    def op_binop(self, q):
        """An operator between values at least one of which is the solution's (the judge checks
        what may come back)."""
        import operator

        name = q.get("name")
        if name not in _OPERATORS:
            raise ValueError(f"operator {name!r} is not forwarded")
        fn = getattr(operator, name)
        return fn(self.decode(q["a"])) if name in _UNARY else fn(self.decode(q["a"]), self.decode(q["b"]))

    def op_stdio(self, q):
        """Run the whole program on one stdin; the judge compares what it printed."""
        data = q.get("in")
        if type(data) is not str or self.code is None:
            raise wire.WireError("bad stdio question")
        with open(".stdin", "wb") as f:
            f.write(data.encode("utf-8", "surrogateescape"))
        fd = os.open(".stdin", os.O_RDONLY)
        if fd != 0:  # (0 when the last case's program closed its stdin)
            os.dup2(fd, 0)
            os.close(fd)
        os.unlink(".stdin")
        saved = sys.stdin, sys.stdout
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sink = self.text_sink(self.output_cap)
        sys.stdout = sink
        error = None
        try:
            exec(self.code, {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as exc:
            if exc.code not in (None, 0):
                error = self._text(exc)
        except BaseException as exc:  # noqa: BLE001 - the case fails with this message
            error = self._text(exc)
        finally:
            try:
                sys.stdout.flush()
            except BaseException:  # noqa: BLE001
                pass
            sys.stdin, sys.stdout = saved
        return {"out": self.sink_text(sink), "err": error}

    def op_capture(self, q):
        """capsys: 'start' sends stdout/stderr to buffers, 'read' returns and empties them,
        'stop' puts the streams back."""
        action = q.get("action")
        if action == "start" and self.capture is None:
            self.capture = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = self.text_sink(self.output_cap), self.text_sink(self.output_cap)
            return None
        if self.capture is None:
            return {"out": "", "err": ""}
        out, err = self.sink_text(sys.stdout), self.sink_text(sys.stderr)
        if action == "stop":
            sys.stdout, sys.stderr = self.capture
            self.capture = None
        else:
            sys.stdout, sys.stderr = self.text_sink(self.output_cap), self.text_sink(self.output_cap)
        return {"out": out, "err": err}


def _plain_copy(value):
    """A deep copy of plain data, for telling afterwards whether a call changed an argument."""
    t = type(value)
    if t is list:
        return [_plain_copy(v) for v in value] if set(map(type, value)) & _CONTAINERS else value[:]
    if t is dict:
        return {k: _plain_copy(v) for k, v in value.items()}
    if t is set or t is bytearray:
        return t(value)
    return value


def _same(value, old) -> bool:
    try:
        return type(value) is type(old) and bool(value == old)
    except BaseException:  # noqa: BLE001 - the call put something odd in it: send it
        return False


_CONTAINERS = frozenset({list, dict, set, bytearray})
_UNARY = frozenset({"neg", "pos", "invert", "abs"})
_OPERATORS = _UNARY | frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_",
                                 "xor", "lshift", "rshift", "lt", "le", "gt", "ge", "eq", "ne"})


def _refuse(obj):
    raise ValueError("not plain data")

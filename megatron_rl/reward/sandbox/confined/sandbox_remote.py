"""The judge's view of the solution: proxies that turn every use into a question over the wire.

Loaded only in the judge process (trusted; it runs the dataset's tests). The solution lives in
another process, so the tests see it through :class:`Remote`:

* a value the solution returns arrives as **plain data** decoded by the judge
  (:func:`sandbox_wire.decode`: exact built-in types, made here), so ``assert candidate(x) ==
  y`` compares two of the judge's own objects with the judge's own ``==``. An object whose
  ``__eq__`` always says yes, an ``int`` subclass, a ``__repr__`` that raises or a ``__del__``
  that raises SystemExit never leave the solution's process;
* anything else (an instance of the solution's class, a generator, a function) is a
  :class:`Proxy`: calls, attributes, items, iteration, ``len``, truth and text are forwarded
  (their results are again plain data or proxies). A proxy never poses as plain data: compared
  with anything but another proxy it is unordered and equal only to itself; arithmetic on it
  must give another proxy (so ``abs(candidate(x) - y) < eps`` cannot be answered by the
  solution's ``__sub__``); ``float()``, ``int()``, ``__index__`` and hashing by value are not
  forwarded. Between two proxies (two of the solution's objects), ``==`` and ordering are the
  solution's answers, as they would be in one interpreter;
* an exception raised by the solution is re-raised here as the built-in class of the same name
  (or a class made here, subclassing the nearest built-in one, for the solution's own
  exception classes), so ``pytest.raises(ValueError)`` works;
* plain containers passed as arguments travel by value and their state after the call is
  copied back into the caller's objects (in-place algorithms: ``rotate(nums)``);
* the judge's own callables and objects passed as arguments stay here: the solution gets a
  stand-in whose uses come back as questions (calls, public attributes, iteration, ...).

Any protocol violation or the solution's process going away raises :class:`SolutionGone`
(a BaseException, so a test's ``except Exception`` cannot swallow it) and marks the run
:attr:`Remote.broken`: the verdict is then 'failed' whatever the tests did afterwards.
"""
from __future__ import annotations

import builtins
import types

import sandbox_wire as wire

_BUILTIN_EXCEPTIONS = {name: cls for name, cls in vars(builtins).items()
                       if isinstance(cls, type) and issubclass(cls, BaseException)}
_MUTABLE = (list, dict, set, bytearray)
_MUTABLE_TYPES = frozenset(_MUTABLE)


class SolutionGone(BaseException):
    """The solution's process broke the protocol or ended; the run fails."""


class Remote:
    """The channel to the solution's process plus the handle tables of both directions."""

    def __init__(self, read_fd: int, write_fd: int, max_bytes: int = wire.MAX_BYTES) -> None:
        self.channel = wire.Channel(read_fd, write_fd, self._answer, max_bytes)
        self.proxies: dict[int, object] = {}
        self.exported: list = []
        self.exported_ids: dict[int, int] = {}
        self.broken = ""

    # ------------------------------------------------------------------ asking
    def ask(self, op: str, **fields):
        """Ask the solution's process; returns the decoded value or raises its exception."""
        return self._value(self._request(op, fields), ())

    def _request(self, op: str, fields: dict) -> dict:
        if self.broken:
            raise SolutionGone(self.broken)
        try:
            reply = self.channel.request(dict(fields, op=op))
        except wire.WireError as exc:
            self.fail(str(exc))
        return reply

    def _value(self, reply: dict, sync_targets):
        try:
            if "v" in reply:
                value = wire.decode(reply["v"], self._resolve)
                if sync_targets:
                    self._apply_sync(reply.get("sync"), sync_targets)
                return value
            if "e" in reply:
                exc = self._exception(reply["e"])
            else:
                raise wire.WireError("a reply with neither value nor exception")
        except wire.WireError as exc:
            self.fail(str(exc))
        raise exc

    def fail(self, why: str):
        self.broken = self.broken or f"the solution's process broke the protocol or ended: {why}"
        raise SolutionGone(self.broken)

    def get(self, name: str):
        return self.ask("get", name=name)

    def call(self, handle: int, args: tuple, kwargs: dict, method: str | None = None):
        """Call the handle (or its method ``method``); mutable plain arguments get the
        solution's changes copied back."""
        targets = {i: a for i, a in enumerate(args) if type(a) in _MUTABLE}
        targets.update({k: v for k, v in kwargs.items() if type(v) in _MUTABLE})
        fields = {"h": handle, "a": self.encode(list(args)), "k": self.encode(dict(kwargs))}
        if method is not None:
            fields["name"] = method
        if targets:
            fields["sync"] = list(targets)
        return self._value(self._request("call", fields), targets)

    def _apply_sync(self, states, targets: dict) -> None:
        """Arguments the solution reports as changed by the call (absent: unchanged)."""
        if states is None:
            return
        if type(states) is not list:
            raise wire.WireError("bad argument states")
        for pair in states:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (int, str) or pair[0] not in targets:
                raise wire.WireError("bad argument state")
            _sync_into(targets[pair[0]], wire.decode(pair[1], self._resolve))

    # ------------------------------------------------------------------ values
    def encode(self, value):
        return wire.encode(value, self._tag)

    def _tag(self, obj) -> dict:
        if type(obj) is Proxy:
            return {"P": [object.__getattribute__(obj, "_h"), None]}
        handle = getattr(obj, "_sandbox_handle", None) if isinstance(obj, type) else None
        if type(handle) is int and self.proxies.get(handle) is obj:
            return {"P": [handle, None]}
        ref = _std_ref(obj)
        if ref is not None:
            return {"std": ref}
        key = id(obj)
        if key not in self.exported_ids:
            self.exported_ids[key] = len(self.exported)
            self.exported.append(obj)
        return {"J": self.exported_ids[key]}

    def _resolve(self, tag: str, body):
        if tag == "std":
            if type(body) is not list or len(body) != 2:
                raise wire.WireError("bad reference")
            return wire.std_lookup(*body)
        if tag == "J":
            if type(body) is not int or not 0 <= body < len(self.exported):
                raise wire.WireError("unknown judge handle")
            return self.exported[body]
        if type(body) is not list or len(body) != 2 or type(body[0]) is not int or body[0] < 0:
            raise wire.WireError("bad handle")
        handle, meta = body
        if handle not in self.proxies:
            meta = meta if type(meta) is dict else {}
            if meta.get("exc") is not None:
                self.proxies[handle] = self._exception_class(handle, meta["exc"])
            else:
                methods = meta.get("m") or []
                if type(methods) is not list or not all(type(m) is str for m in methods):
                    raise wire.WireError("bad method list")
                self.proxies[handle] = Proxy(self, handle, frozenset(methods))
        return self.proxies[handle]

    def _exception_class(self, handle: int, spec) -> type:
        if type(spec) is not list or len(spec) != 2 or type(spec[0]) is not str or not spec[0].isidentifier() \
                or type(spec[1]) is not list:
            raise wire.WireError("bad exception class")
        base = next((_BUILTIN_EXCEPTIONS[n] for n in spec[1] if type(n) is str and n in _BUILTIN_EXCEPTIONS),
                    Exception)
        if base in (BaseException, object):
            base = Exception
        return type(spec[0], (base,), {"__module__": "solution", "_sandbox_handle": handle})

    def _exception(self, desc) -> BaseException:
        if type(desc) is not dict or type(desc.get("n")) is not str or type(desc.get("s")) is not str:
            raise wire.WireError("bad exception")
        cls = None
        if type(desc.get("c")) is int:
            cls = self._resolve("P", [desc["c"], {"exc": [desc["n"], desc.get("b") or []]}])
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                cls = None
        if cls is None:
            cls = _BUILTIN_EXCEPTIONS.get(desc["n"], Exception)
        args = wire.decode(desc["a"], self._resolve) if "a" in desc else [desc["s"]]
        if type(args) is not list:
            args = [desc["s"]]
        if getattr(cls, "_sandbox_handle", None) is not None:
            args = [desc["s"]]  # the solution's own class: show its message
        try:
            exc = cls(*args)
        except Exception:  # noqa: BLE001 - constructors with required arguments (UnicodeError...)
            exc = cls.__new__(cls)
            exc.args = tuple(args)
        return exc

    # ------------------------------------------------------------------ callbacks
    def _answer(self, question: dict) -> dict:
        """The solution asks about one of our objects it was given."""
        try:
            op, handle = question.get("op"), question.get("h")
            if type(handle) is not int or not 0 <= handle < len(self.exported):
                raise wire.WireError("unknown judge handle")
            target = self.exported[handle]
            arg = lambda key: wire.decode(question.get(key), self._resolve)  # noqa: E731
            name = question.get("name")
            if op in ("getattr", "setattr") and (type(name) is not str or name.startswith("_")):
                raise AttributeError(f"attribute {name!r} is not available to the solution")
            if op == "call":
                args, kwargs = arg("a"), arg("k")
                if type(args) is not list or type(kwargs) is not dict:
                    raise wire.WireError("bad callback arguments")
                value = target(*args, **kwargs)
            elif op == "getattr":
                value = getattr(target, name)
            elif op == "setattr":
                value = setattr(target, name, arg("v"))
            elif op == "iter":
                value = iter(target)
            elif op == "next":
                value = next(target)
            elif op == "len":
                value = len(target)
            elif op == "getitem":
                value = target[arg("key")]
            elif op == "contains":
                value = arg("v") in target
            elif op == "bool":
                value = bool(target)
            elif op in ("str", "repr"):
                value = (str if op == "str" else repr)(target)
            else:
                raise wire.WireError(f"unknown callback {op!r}")
            return {"v": self.encode(value)}
        except wire.WireError as exc:
            self.broken = self.broken or f"the solution's process broke the protocol: {exc}"
            return {"e": {"n": "RuntimeError", "b": [], "s": "protocol error"}}
        except Exception as exc:  # noqa: BLE001 - the test's callback raised: tell the solution
            return {"e": {"n": type(exc).__name__, "b": [], "s": str(exc)[:2000]}}


def _std_ref(obj):
    if type(obj) is types.ModuleType:
        return [obj.__name__, ""] if obj.__name__ in wire.STD_MODULES else None
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType)):
        owner = getattr(obj, "__objclass__", None)
        module = getattr(owner if owner is not None else obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if type(module) is str and module in wire.STD_MODULES and type(qualname) is str:
            try:
                if wire.std_lookup(module, qualname) is obj:
                    return [module, qualname]
            except (ImportError, AttributeError, ValueError):
                return None
    return None


def _sync_into(old, new) -> None:
    """Make ``old`` (the caller's container) hold ``new``'s content, keeping the identity of
    nested containers of the same kind (rows of a matrix rotated in place). Both are plain data
    built here, so comparing them runs no code of the solution's."""
    if type(old) is type(new) and old == new:
        return
    if type(old) is list and type(new) is list:
        if not set(map(type, old)) & _MUTABLE_TYPES:
            old[:] = new  # no nested containers whose identity could matter
            return
        for i in range(min(len(old), len(new))):
            if type(old[i]) is type(new[i]) and type(old[i]) in _MUTABLE:
                _sync_into(old[i], new[i])
            else:
                old[i] = new[i]
        del old[len(new):]
        old.extend(new[len(old):])
    elif type(old) is dict and type(new) is dict:
        for key in [k for k in old if k not in new]:
            del old[key]
        for key, value in new.items():
            if key in old and type(old[key]) is type(value) and type(value) in _MUTABLE:
                _sync_into(old[key], value)
            else:
                old[key] = value
    elif type(old) is set and type(new) is set:
        old.clear()
        old.update(new)
    elif type(old) is bytearray and type(new) is bytearray:
        old[:] = new


class Proxy:
    """One object of the solution's; see the module docstring for what is forwarded."""

    __slots__ = ("_r", "_h", "_m", "__weakref__")

    def __init__(self, remote: Remote, handle: int, methods: frozenset = frozenset()) -> None:
        object.__setattr__(self, "_r", remote)
        object.__setattr__(self, "_h", handle)
        object.__setattr__(self, "_m", methods)

    def _ask(self, op: str, **fields):
        return self._r.ask(op, h=self._h, **fields)

    def __call__(self, *args, **kwargs):
        return self._r.call(self._h, args, kwargs)

    def __getattr__(self, name: str):
        if name in self._m:
            return _Method(self, name)  # called right away in the usual case: one question, not two
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", name=name, v=self._r.encode(value))

    def __delattr__(self, name: str) -> None:
        self._ask("delattr", name=name)

    def __getitem__(self, key):
        return self._ask("getitem", key=self._r.encode(key))

    def __setitem__(self, key, value) -> None:
        self._ask("setitem", key=self._r.encode(key), v=self._r.encode(value))

    def __delitem__(self, key) -> None:
        self._ask("delitem", key=self._r.encode(key))

    def __contains__(self, value) -> bool:
        return bool(self._ask("contains", v=self._r.encode(value)))

    def __len__(self) -> int:
        return self._ask("len")

    def __bool__(self) -> bool:
        return self._ask("bool")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __str__(self) -> str:
        return self._ask("str")

    def __repr__(self) -> str:
        return self._ask("repr")

    def __instancecheck__(self, obj) -> bool:
        return self._ask("isinstance", v=self._r.encode(obj)) is True

    def __subclasscheck__(self, cls) -> bool:
        return self._ask("issubclass", v=self._r.encode(cls)) is True

    # Comparisons are answered only between two of the solution's objects (the solution decides
    # about its own objects anyway) and must answer a bool; against anything else a proxy is
    # unordered and equal only to itself.
    def _compare(self, name: str, other):
        if type(other) is not Proxy or object.__getattribute__(other, "_r") is not self._r:
            return NotImplemented
        if self is other and name in ("eq", "ne"):
            return name == "eq"
        answer = self._ask("binop", name=name, a={"P": [self._h, None]}, b={"P": [other._h, None]})
        if type(answer) is not bool:
            raise TypeError(f"comparison of solution objects answered {type(answer).__name__}, not bool")
        return answer

    def __eq__(self, other):
        return self._compare("eq", other)

    def __ne__(self, other):
        return self._compare("ne", other)

    def __lt__(self, other):
        return self._compare("lt", other)

    def __le__(self, other):
        return self._compare("le", other)

    def __gt__(self, other):
        return self._compare("gt", other)

    def __ge__(self, other):
        return self._compare("ge", other)

    __hash__ = object.__hash__

    # Arithmetic is forwarded but must give another of the solution's objects: it can never
    # mint a plain number for the tests to compare (``abs(candidate(x) - y) < 1e-9`` with a
    # proxy raises TypeError instead of trusting the solution's ``__sub__``).
    def _arith(self, name: str, a, b):
        answer = self._ask("binop", name=name, a=self._r.encode(a), b=self._r.encode(b))
        if type(answer) is not Proxy:
            raise TypeError(f"arithmetic on a solution object gave {type(answer).__name__}; only its own objects "
                            "may come out of it")
        return answer


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
              "rshift"):
    _op = _name + "_" if _name in ("and", "or") else _name
    setattr(Proxy, f"__{_name}__", lambda self, other, _op=_op: self._arith(_op, self, other))
    setattr(Proxy, f"__r{_name}__", lambda self, other, _op=_op: self._arith(_op, other, self))
for _name in ("neg", "pos", "invert", "abs"):
    setattr(Proxy, f"__{_name}__", lambda self, _op=_name: self._arith(_op, self, None))
del _name, _op


class _Method:
    """``proxy.name`` for a method of the solution's class: calling it asks the solution to
    look the attribute up and call it (so an instance attribute of that name still wins)."""

    __slots__ = ("_proxy", "_name")

    def __init__(self, proxy: Proxy, name: str) -> None:
        self._proxy, self._name = proxy, name

    def __call__(self, *args, **kwargs):
        proxy = self._proxy
        return object.__getattribute__(proxy, "_r").call(object.__getattribute__(proxy, "_h"), args, kwargs,
                                                          self._name)

    def __repr__(self) -> str:
        return f"<method {self._name} of a solution object>"


class LiveNamespace(dict):
    """Globals of an asserts-style test program: names the tests do not define themselves are
    looked up in the solution's module at the time of use, except that the solution cannot
    shadow a built-in (``abs``, ``sorted``, ``isinstance``...) other than the entry point, and a
    standard-library module name the solution imported is the judge's own module."""

    def __init__(self, remote: Remote, names: list[str], entry_point: str = "") -> None:
        super().__init__()
        self._remote, self._names, self._entry = remote, frozenset(names), entry_point

    def __missing__(self, key: str):
        if key in self._names and (key == self._entry or key not in _BUILTIN_NAMES):
            if key in wire.STD_MODULES:
                value = wire.std_lookup(key, "")
            else:
                value = self._remote.get(key)
            if type(value) is Proxy or isinstance(value, (type, types.ModuleType, types.FunctionType)):
                self[key] = value  # stable objects: look them up once
            return value
        raise KeyError(key)


_BUILTIN_NAMES = frozenset(vars(builtins))


class RemoteModule(types.ModuleType):
    """``solution`` for pytest-style tests (``from solution import f``): attributes are looked up
    in the solution's module when they are read."""

    def __init__(self, remote: Remote, names: list[str]) -> None:
        super().__init__("solution")
        self.__dict__["_remote"] = remote
        self.__dict__["__all__"] = [n for n in names if not n.startswith("_")]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["_remote"].get(name)

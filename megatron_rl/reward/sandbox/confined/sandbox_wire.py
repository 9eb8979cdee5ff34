"""The wire between a sandbox run's two processes: framing, plain-data values, nested calls.

Stdlib only: loaded by the judge (trusted) and by the solution process (untrusted) alike, each
its own copy. Nothing in it trusts what it receives: a message is a 4-byte big-endian length and
that much UTF-8 JSON (at most ``max_bytes``), and values are decoded by :func:`decode` into
fresh objects of exact built-in types, so the receiver never runs code of the sender's making.

**Plain data** is what crosses by value: None, bool, int, float, complex, str, bytes, bytearray,
and list / tuple / dict / set / frozenset of plain data, plus a few value types of the standard
library rebuilt from their parts by the receiver (Decimal, Fraction, date, time, datetime,
timedelta, deque, OrderedDict, Counter, defaultdict with a built-in factory, range, named
tuples). The sender decides by *exact* type (``type(x) is list``, never ``isinstance``), so a
subclass with its own ``__eq__`` is not plain; anything else crosses as a handle
(``{"P": [id, meta]}`` from the solution, ``{"J": id}`` from the judge) or as a reference to a
standard-library object (``{"std": [module, qualname]}``), which the receiver resolves in its
own interpreter. A JSON object on the wire always has exactly one key, the tag.
"""
from __future__ import annotations

import binascii
import os
import sys

MAX_BYTES = 256 << 20
MAX_DEPTH = 400
_NATIVE = frozenset({type(None), bool, int, float, str})
_SMALL_INT_BITS = 4000  # beyond this, ints travel as hex (int <-> decimal text is size-limited)


STD_MODULES = frozenset({
    "builtins", "math", "cmath", "collections", "collections.abc", "itertools", "functools", "operator", "heapq",
    "bisect", "string", "re", "typing", "dataclasses", "enum", "fractions", "decimal", "statistics", "datetime",
    "json", "copy", "random", "array", "numbers", "abc", "types", "textwrap", "unicodedata", "calendar", "time",
    "zoneinfo", "hashlib", "base64", "binascii", "struct", "contextlib", "difflib", "queue", "graphlib",
    "pprint", "keyword"})
"""Standard-library modules whose module-level objects (the modules themselves, their classes
and functions) cross as references and are resolved by the receiver in its own interpreter."""
_DANGEROUS_BUILTINS = ("eval", "exec", "compile", "open", "input", "breakpoint", "__import__", "globals",
                       "locals", "vars", "getattr", "setattr", "delattr", "exit", "quit", "help")


class WireError(Exception):
    """A malformed, oversized or unexpected message, or the other side went away."""


# --------------------------------------------------------------------------- JSON
# The C halves of the json module, used directly: ``import json`` pulls in ``re`` and ``enum``,
# which would add tens of milliseconds to every sandbox process's start-up.
try:
    import _json

    class _ScanContext:
        strict = True
        object_hook = object_pairs_hook = None
        parse_float, parse_int = float, int
        parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__

    _scan = _json.make_scanner(_ScanContext)

    def _no_default(obj):
        raise TypeError(f"{type(obj).__name__} is not JSON data")

    _encode = _json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ":", ",", False, False, True)

    def dumps(obj) -> str:
        """Compact JSON text of ``obj`` (dict keys must be str)."""
        return "".join(_encode(obj, 0))

    def loads(text: str):
        """The value of one JSON document with nothing after it; ValueError otherwise."""
        try:
            value, end = _scan(text, 0)
        except StopIteration as exc:
            raise ValueError(f"not JSON at {exc.value}") from None
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if end != len(text):
            raise ValueError(f"extra data at {end}")
        return value
except (ImportError, AttributeError, TypeError):  # another implementation: the plain module
    import json as _json_module

    def dumps(obj) -> str:
        return _json_module.dumps(obj, separators=(",", ":"))

    def loads(text: str):
        return _json_module.loads(text)


# --------------------------------------------------------------------------- framing
def send(fd: int, message) -> None:
    data = dumps(message).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError as exc:
            raise WireError(f"cannot send: {exc}") from None


def _read(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except OSError as exc:
            raise WireError(f"cannot receive: {exc}") from None
        if not chunk:
            raise WireError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(fd: int, max_bytes: int = MAX_BYTES):
    size = int.from_bytes(_read(fd, 4), "big")
    if size > max_bytes:
        raise WireError(f"message of {size} bytes is over the {max_bytes}-byte limit")
    try:
        return loads(_read(fd, size).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"malformed message: {str(exc)[:200]}") from None


class Channel:
    """Strictly nested request/reply over two pipes. ``request`` sends a question and, while it
    waits for the answer, answers the other side's questions with ``handler`` (so either side
    may call back into the other, to any depth)."""

    def __init__(self, read_fd: int, write_fd: int, handler, max_bytes: int = MAX_BYTES) -> None:
        self.read_fd, self.write_fd, self.handler, self.max_bytes = read_fd, write_fd, handler, max_bytes

    def request(self, question: dict) -> dict:
        send(self.write_fd, {"q": question})
        while True:
            message = self._next()
            if "r" in message:
                return message["r"]
            self._answer(message["q"])

    def serve(self) -> None:
        """Answer questions until the other side closes the channel (WireError)."""
        while True:
            message = self._next()
            if "q" not in message:
                raise WireError("a reply with no question pending")
            self._answer(message["q"])

    def _next(self) -> dict:
        message = recv(self.read_fd, self.max_bytes)
        if type(message) is not dict or len(message) != 1 or not ("q" in message or "r" in message) \
                or type(next(iter(message.values()))) is not dict:
            raise WireError("a message that is neither a question nor a reply")
        return message

    def _answer(self, question: dict) -> None:
        send(self.write_fd, {"r": self.handler(question)})


# --------------------------------------------------------------------------- values
def std_lookup(module, qualname):
    """The object a ``{"std": [module, qualname]}`` reference names, in this interpreter.
    Only public names of :data:`STD_MODULES`, and never the builtins that evaluate code, open
    files or reach into namespaces (a reference is a value the receiver may end up calling)."""
    if type(module) is not str or type(qualname) is not str or module not in STD_MODULES:
        raise ValueError(f"not an allowed standard-library reference: {module!r}")
    import builtins
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        if not part.isidentifier() or part.startswith("_"):
            raise ValueError(f"not an allowed standard-library name: {qualname!r}")
        obj = getattr(obj, part)
    if any(obj is getattr(builtins, name, None) for name in _DANGEROUS_BUILTINS) or obj is importlib.import_module:
        raise ValueError(f"{module}.{qualname} may not be passed as a value")
    return obj


def _mod(name: str):
    return sys.modules.get(name)


def _flat(values) -> bool:
    """True when every item is a JSON-native scalar (ints small enough): no per-item work."""
    kinds = set(map(type, values))
    if not kinds <= _NATIVE:
        return False
    if int in kinds:
        ints = values if len(kinds) == 1 else [v for v in values if type(v) is int]
        return max(ints).bit_length() <= _SMALL_INT_BITS and min(ints).bit_length() <= _SMALL_INT_BITS
    return True


_PACK_MIN = 256
_I64 = 1 << 63


def _packed(values: list):
    """Long lists of only ints (within int64) or only floats travel as raw machine words:
    several times cheaper than JSON numbers both ways."""
    if len(values) < _PACK_MIN:
        return None
    kinds = set(map(type, values))
    if kinds == {int} and -_I64 <= min(values) and max(values) < _I64:
        code, tag = "q", "ai"
    elif kinds == {float}:
        code, tag = "d", "af"
    else:
        return None
    import array

    return {tag: binascii.b2a_base64(array.array(code, values).tobytes(), newline=False).decode("ascii")}


def _unpack(code: str, body) -> list:
    import array

    raw = binascii.a2b_base64(_str(body), strict_mode=True)
    if len(raw) % 8:
        raise WireError("packed numbers of a bad length")
    numbers = array.array(code)
    numbers.frombytes(raw)
    return numbers.tolist()


def encode(value, other, depth: int = 0):
    """JSON-ready form of ``value``; ``other(obj)`` gives the tag of anything not plain."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to send")
    t = type(value)
    if t in _NATIVE:
        if t is int and value.bit_length() > _SMALL_INT_BITS:
            return {"i": hex(value)}
        return value
    d = depth + 1
    if t is list:
        packed = _packed(value)
        if packed is not None:
            return packed
        return value if _flat(value) else [encode(v, other, d) for v in value]
    if t is dict:
        if all(type(k) is str for k in value):
            return {"m": {k: encode(v, other, d) for k, v in value.items()}}
        return {"d": [[encode(k, other, d), encode(v, other, d)] for k, v in value.items()]}
    if t is tuple:
        return {"t": encode(list(value), other, d)}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": encode(list(value), other, d)}
    if t is bytes or t is bytearray:
        return {"b" if t is bytes else "y": binascii.b2a_base64(value, newline=False).decode("ascii")}
    if t is complex:
        return {"c": [value.real, value.imag]}
    if t is range:
        return {"rg": [value.start, value.stop, value.step]}
    tagged = _encode_stdlib_value(value, t, other, d)
    return other(value) if tagged is None else tagged


def _encode_stdlib_value(value, t, other, d):
    decimal, fractions, datetime, collections = (_mod(n) for n in ("decimal", "fractions", "datetime", "collections"))
    if decimal is not None and t is decimal.Decimal:
        return {"dec": str(value)}
    if fractions is not None and t is fractions.Fraction:
        return {"fr": [encode(value.numerator, other, d), encode(value.denominator, other, d)]}
    if datetime is not None:
        if t is datetime.datetime:
            off = value.utcoffset()
            return {"dt": [value.year, value.month, value.day, value.hour, value.minute, value.second,
                           value.microsecond, None if off is None else off.total_seconds(), value.fold]}
        if t is datetime.date:
            return {"da": [value.year, value.month, value.day]}
        if t is datetime.time:
            off = value.utcoffset()
            return {"ti": [value.hour, value.minute, value.second, value.microsecond,
                           None if off is None else off.total_seconds()]}
        if t is datetime.timedelta:
            return {"td": [value.days, value.seconds, value.microseconds]}
    if collections is not None:
        if t is collections.deque:
            return {"dq": [encode(list(value), other, d), value.maxlen]}
        if t is collections.OrderedDict or t is collections.Counter:
            return {"od" if t is collections.OrderedDict else "cn":
                    [[encode(k, other, d), encode(v, other, d)] for k, v in value.items()]}
        if t is collections.defaultdict:
            factory = value.default_factory
            name = factory.__name__ if factory in (int, float, str, list, dict, set, tuple, bool) else None
            return {"dd": [name, [[encode(k, other, d), encode(v, other, d)] for k, v in value.items()]]}
    if isinstance(value, tuple) and t.__bases__ == (tuple,) and type(getattr(t, "_fields", None)) is tuple:
        return {"nt": [t.__name__, list(t._fields), encode(list(value), other, d)]}
    return None


_TUPLE_CLASSES: dict[tuple, type] = {}
_FACTORIES = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set, "tuple": tuple,
              "bool": bool}


def decode(data, resolve, depth: int = 0):
    """The value ``data`` (JSON-decoded) stands for, built from exact built-in types;
    ``resolve(tag, body)`` turns 'P' / 'J' / 'std' tags into objects. Raises WireError on
    anything malformed."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(data)
    if t in _NATIVE:
        return data
    d = depth + 1
    if t is list:
        if set(map(type, data)) <= _NATIVE:
            return data
        return [decode(v, resolve, d) for v in data]
    if t is not dict or len(data) != 1:
        raise WireError(f"not a value: {str(data)[:80]}")
    (tag, body), = data.items()
    try:
        return _decode_tagged(tag, body, resolve, d)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError, ArithmeticError, AttributeError, ImportError,
            binascii.Error) as exc:
        raise WireError(f"bad {tag!r} value: {str(exc)[:120]}") from None


def _items(body, resolve, d) -> list:
    if type(body) is not list:
        raise WireError("expected a list")
    return [decode(v, resolve, d) for v in body]


def _pairs(body, resolve, d) -> list[tuple]:
    if type(body) is not list or not all(type(p) is list and len(p) == 2 for p in body):
        raise WireError("expected [key, value] pairs")
    return [(decode(k, resolve, d), decode(v, resolve, d)) for k, v in body]


def _decode_tagged(tag, body, resolve, d):
    if tag == "m":
        if type(body) is not dict:
            raise WireError("expected an object")
        return {k: decode(v, resolve, d) for k, v in body.items()}
    if tag == "d":
        return dict(_pairs(body, resolve, d))
    if tag == "t":
        return tuple(_items(body, resolve, d))
    if tag == "s":
        return set(_items(body, resolve, d))
    if tag == "f":
        return frozenset(_items(body, resolve, d))
    if tag in ("b", "y"):
        raw = binascii.a2b_base64(_str(body), strict_mode=True)
        return raw if tag == "b" else bytearray(raw)
    if tag == "i":
        return int(_str(body), 16)
    if tag == "c":
        re_, im = _items(body, resolve, d)
        return complex(_num(re_), _num(im))
    if tag in ("ai", "af"):
        return _unpack("q" if tag == "ai" else "d", body)
    if tag == "rg":
        return range(*[_int(x) for x in _items(body, resolve, d)])
    if tag in ("P", "J", "std"):
        return resolve(tag, body)
    return _decode_stdlib_value(tag, body, resolve, d)


def _decode_stdlib_value(tag, body, resolve, d):
    import collections
    import datetime

    if tag == "dec":
        import decimal
        return decimal.Decimal(_str(body))
    if tag == "fr":
        import fractions
        num, den = _items(body, resolve, d)
        return fractions.Fraction(_int(num), _int(den))
    if tag in ("dt", "ti"):
        parts = _items(body, resolve, d)
        tz = None if parts[-1 if tag == "ti" else -2] is None else \
            datetime.timezone(datetime.timedelta(seconds=_num(parts[-1 if tag == "ti" else -2])))
        if tag == "ti":
            return datetime.time(*[_int(x) for x in parts[:4]], tzinfo=tz)
        return datetime.datetime(*[_int(x) for x in parts[:7]], tzinfo=tz, fold=_int(parts[8]))
    if tag == "da":
        return datetime.date(*[_int(x) for x in _items(body, resolve, d)])
    if tag == "td":
        return datetime.timedelta(*[_int(x) for x in _items(body, resolve, d)])
    if tag == "dq":
        items, maxlen = body
        return collections.deque(_items(items, resolve, d), None if maxlen is None else _int(maxlen))
    if tag == "od":
        return collections.OrderedDict(_pairs(body, resolve, d))
    if tag == "cn":
        return collections.Counter(dict(_pairs(body, resolve, d)))
    if tag == "dd":
        factory, pairs = body
        if factory is not None and factory not in _FACTORIES:
            raise WireError(f"defaultdict factory {factory!r}")
        return collections.defaultdict(_FACTORIES.get(factory), _pairs(pairs, resolve, d))
    if tag == "nt":
        name, fields, values = body
        if type(name) is not str or type(fields) is not list or not all(type(f) is str for f in fields):
            raise WireError("bad named tuple")
        key = (name, tuple(fields))
        if key not in _TUPLE_CLASSES:
            _TUPLE_CLASSES[key] = collections.namedtuple(name, fields)
        return _TUPLE_CLASSES[key](*_items(values, resolve, d))
    raise WireError(f"unknown value tag {tag!r}")


def _str(x) -> str:
    if type(x) is not str:
        raise WireError("expected a string")
    return x


def _int(x) -> int:
    if type(x) is not int:
        raise WireError("expected an int")
    return x


def _num(x) -> float:
    if type(x) not in (int, float):
        raise WireError("expected a number")
    return x

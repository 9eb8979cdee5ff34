"""The pytest helpers that code datasets' test files use, for the judge process (where it is
registered as ``pytest``; the real pytest is not available there).

``raises`` (context manager and call forms, ``match=``, ``excinfo.value``/``.type``),
``approx`` (numbers, sequences, dicts), ``fail``, ``skip``, ``importorskip``, ``param``,
``fixture`` (function scope; plain and generator fixtures), ``mark.parametrize`` (stacked, with
``pytest.param``), ``mark.skip`` / ``skipif`` / ``xfail`` / ``usefixtures``; any other mark is
accepted and ignored. The runner that reads these marks is :mod:`sandbox_judge`.
"""
import math


class Skipped(Exception):
    """Raised by ``pytest.skip`` inside a test: the test does not count."""


class Failed(AssertionError):
    """Raised by ``pytest.fail``."""


def fail(reason: str = "", pytrace: bool = True):
    raise Failed(reason)


def skip(reason: str = "", allow_module_level: bool = False):
    raise Skipped(reason)


def importorskip(name: str, minversion=None, reason=None):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise Skipped(reason or f"could not import {name!r}") from None


class ExceptionInfo:
    def __init__(self) -> None:
        self.type = self.value = self.tb = None

    def match(self, regexp) -> bool:
        import re

        if not re.search(regexp, str(self.value)):
            raise AssertionError(f"Regex pattern {regexp!r} does not match {str(self.value)!r}")
        return True

    def errisinstance(self, exc) -> bool:
        return isinstance(self.value, exc)


class _Raises:
    def __init__(self, expected, match=None) -> None:
        self.expected, self.match, self.info = expected, match, ExceptionInfo()

    def __enter__(self) -> ExceptionInfo:
        return self.info

    def __exit__(self, typ, value, tb) -> bool:
        if typ is None:
            raise Failed(f"DID NOT RAISE {self.expected}")
        if not issubclass(typ, self.expected):
            return False
        self.info.type, self.info.value, self.info.tb = typ, value, tb
        if self.match is not None:
            self.info.match(self.match)
        return True


def raises(expected, *args, match=None, **kwargs):
    if args:
        context = _Raises(expected, match)
        with context:
            args[0](*args[1:], **kwargs)
        return context.info
    return _Raises(expected, match)


def warns(expected_warning=Warning, *args, match=None, **kwargs):
    import re
    import warnings

    class _Warns:
        def __enter__(self):
            self._catch = warnings.catch_warnings(record=True)
            self.list = self._catch.__enter__()
            warnings.simplefilter("always")
            return self

        def __exit__(self, typ, value, tb):
            self._catch.__exit__(typ, value, tb)
            if typ is None and not any(issubclass(w.category, expected_warning) and
                                       (match is None or re.search(match, str(w.message))) for w in self.list):
                raise Failed(f"DID NOT WARN {expected_warning}")
            return False

    context = _Warns()
    if args:
        with context:
            return args[0](*args[1:], **kwargs)
    return context


_NUMBERS = (int, float, complex)


class approx:  # noqa: N801 - pytest's name
    """``actual == approx(expected)`` within ``rel`` (default 1e-6) or ``abs`` (1e-12)."""

    def __init__(self, expected, rel=None, abs=None, nan_ok: bool = False) -> None:  # noqa: A002
        self.expected, self.nan_ok = expected, nan_ok
        self.rel = 1e-6 if rel is None and abs is None else (rel or 0.0)
        self.abs = 1e-12 if abs is None else abs

    def _is_number(self, x) -> bool:
        if type(x) in _NUMBERS:
            return True
        name = type(x).__module__ + "." + type(x).__qualname__
        return name in ("decimal.Decimal", "fractions.Fraction")

    def _close(self, actual, expected) -> bool:
        if not (self._is_number(actual) and self._is_number(expected)):
            return type(actual) is type(expected) and actual == expected
        if actual == expected:
            return True
        if isinstance(expected, complex) or isinstance(actual, complex):
            diff, scale = abs(complex(actual) - complex(expected)), abs(complex(expected))
        else:
            a, e = float(actual), float(expected)
            if math.isnan(a) or math.isnan(e):
                return self.nan_ok and math.isnan(a) and math.isnan(e)
            if math.isinf(a) or math.isinf(e):
                return a == e
            diff, scale = abs(a - e), abs(e)
        return diff <= max(self.rel * scale, self.abs)

    def __eq__(self, actual) -> bool:
        expected = self.expected
        if type(expected) in (list, tuple):
            return type(actual) in (list, tuple) and len(actual) == len(expected) and \
                all(self._close(a, e) for a, e in zip(actual, expected))
        if type(expected) is dict:
            return type(actual) is dict and actual.keys() == expected.keys() and \
                all(self._close(actual[k], expected[k]) for k in expected)
        return self._close(actual, expected)

    def __ne__(self, actual) -> bool:
        return not self.__eq__(actual)

    __hash__ = None

    def __repr__(self) -> str:
        return f"approx({self.expected!r})"


class ParameterSet:
    def __init__(self, values: tuple, marks=()) -> None:
        self.values, self.marks = values, marks


def param(*values, marks=(), id=None):  # noqa: A002 - pytest's name
    return ParameterSet(values, marks)


def _marks(fn) -> dict:
    if "_sandbox_marks" not in fn.__dict__:
        fn._sandbox_marks = {"parametrize": [], "skip": False, "xfail": False, "usefixtures": []}
    return fn._sandbox_marks


class _Mark:
    def parametrize(self, argnames, argvalues, ids=None, indirect=False, scope=None):
        names = [n.strip() for n in argnames.split(",") if n.strip()] if isinstance(argnames, str) else list(argnames)
        rows = []
        for value in argvalues:
            skip_row = False
            if isinstance(value, ParameterSet):
                skip_row = any(getattr(m, "_sandbox_skip", False) for m in value.marks)
                value = value.values if len(names) > 1 else value.values[0]
            if not skip_row:
                rows.append(dict(zip(names, value)) if len(names) > 1 else {names[0]: value})

        def wrap(fn):
            _marks(fn)["parametrize"].append(rows)
            return fn
        return wrap

    def skip(self, fn=None, reason: str = ""):
        return self._flag(fn, "skip")

    def skipif(self, condition=True, reason: str = ""):
        return self._flag(None, "skip") if condition else (lambda fn: fn)

    def xfail(self, fn=None, condition=True, reason: str = "", raises=None, strict=False, run=True):
        return self._flag(fn, "xfail") if condition else (lambda f: f)

    def usefixtures(self, *names):
        def wrap(fn):
            _marks(fn)["usefixtures"].extend(names)
            return fn
        return wrap

    @staticmethod
    def _flag(fn, name: str):
        def wrap(f):
            if isinstance(f, type):
                f._sandbox_class_flag = name
            else:
                _marks(f)[name] = True
            return f
        if callable(fn) and not isinstance(fn, str):
            return wrap(fn)
        marker = wrap
        marker._sandbox_skip = name == "skip"
        return marker

    def __getattr__(self, name: str):
        # timeout, slow, asyncio, ...: accepted and ignored (as decorator or as a mark object).
        def mark(*args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return lambda fn: fn
        return mark


mark = _Mark()


def fixture(fn=None, *, scope: str = "function", params=None, autouse: bool = False, name=None, ids=None):
    def wrap(f):
        f._sandbox_fixture = {"name": name or f.__name__, "autouse": autouse,
                              "params": list(params) if params is not None else None}
        return f
    return wrap(fn) if callable(fn) else wrap


class FixtureRequest:
    def __init__(self, param=None) -> None:
        self.param = param


def main(*args, **kwargs) -> int:
    return 0

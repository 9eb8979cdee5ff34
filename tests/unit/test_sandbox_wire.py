"""The wire between the sandbox's processes: plain data round-trips as exact built-in types,
nothing else passes as data, and malformed input is refused rather than trusted."""
from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import os
import threading

import pytest

from megatron_rl.reward.sandbox.confined import sandbox_wire as wire


def handle(obj):
    return {"P": [id(obj) % 1000, None]}


def roundtrip(value):
    seen = []
    data = wire.loads(wire.dumps(wire.encode(value, lambda o: seen.append(o) or {"P": [len(seen) - 1, None]})))
    return wire.decode(data, lambda tag, body: ("handle", tag, body)), seen


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2 ** 70, 2 ** 20000, -(3 ** 9000), 1.5, float("inf"), -0.0, "héllo\ud800", b"\x00\xff",
    bytearray(b"ab"), 3 + 4j, [1, [2, [3]]], (1, "a", (2,)), {1, 2}, frozenset({"x"}), {"a": 1}, {1: [2], (3, 4): {5}},
    list(range(1000)), [0.5] * 300, [2 ** 62] * 300, range(2, 10, 3), decimal.Decimal("1.10"), fractions.Fraction(1, 3),
    datetime.date(2024, 2, 29), datetime.datetime(2024, 1, 2, 3, 4, 5, 6), datetime.timedelta(days=2, seconds=3),
    datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=2))), datetime.time(1, 2, 3),
    collections.deque([1, 2], maxlen=5), collections.OrderedDict(a=1), collections.Counter("aab"),
    collections.defaultdict(list, {"k": [1]}),
], ids=lambda v: type(v).__name__)
def test_plain_data_round_trips_with_exact_types(value) -> None:
    back, others = roundtrip(value)
    assert others == []
    assert back == value or (value != value and back != back)
    assert type(back) is type(value)
    if isinstance(value, collections.deque):
        assert back.maxlen == value.maxlen
    if isinstance(value, collections.defaultdict):
        assert back.default_factory is list


def test_named_tuples_travel_as_tuples_with_their_fields() -> None:
    point = collections.namedtuple("Point", "x y")(1, 2)
    back, _ = roundtrip(point)
    assert back == (1, 2) and back.x == 1 and type(back).__name__ == "Point"


def test_subclasses_and_objects_are_not_plain_data() -> None:
    class Sly(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Anything:
        def __eq__(self, other):
            return True

    for value in (Sly(3), Anything(), [1, Sly(2)], {"k": Anything()}, type("L", (list,), {})()):
        back, others = roundtrip(value)
        assert others, value  # went to the handle hook, not through as data
        assert "handle" in repr(back)


@pytest.mark.parametrize("data", [
    {"zz": 1}, {"t": [1], "s": [2]}, {"b": "***"}, {"i": "xyz"}, {"nt": ["bad name", ["x"], [1]]},
    {"dd": ["eval", []]}, {"ai": "AAA="}, {"d": [[[1], 2]]}, {"c": ["a", 1]}, {"fr": [1, 0]},
], ids=lambda d: next(iter(d)))
def test_malformed_values_are_refused(data) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(data, lambda tag, body: None)


def test_deep_nesting_is_refused() -> None:
    nested = []
    for _ in range(wire.MAX_DEPTH + 10):
        nested = [nested]
    with pytest.raises(ValueError):
        wire.encode(nested, lambda o: None)
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError):
        wire.loads(deep)


def test_standard_library_references_are_limited() -> None:
    import math

    assert wire.std_lookup("math", "isclose") is math.isclose
    assert wire.std_lookup("collections", "Counter") is collections.Counter
    for module, name in (("builtins", "eval"), ("builtins", "open"), ("builtins", "__import__"), ("os", "system"),
                         ("builtins", "object.__subclasses__"), ("subprocess", ""), ("builtins", "getattr")):
        with pytest.raises(ValueError):
            wire.std_lookup(module, name)


def test_framing_limits_and_nested_requests() -> None:
    a_to_b, b_to_a = os.pipe(), os.pipe()
    # B answers A's questions, and asks A back once while answering.
    b = wire.Channel(a_to_b[0], b_to_a[1], lambda q: {"v": q["x"] + b.request({"y": q["x"]})["v"]})
    a = wire.Channel(b_to_a[0], a_to_b[1], lambda q: {"v": q["y"] * 10})
    server = threading.Thread(target=lambda: pytest.raises(wire.WireError, b.serve), daemon=True)
    server.start()
    assert a.request({"x": 4}) == {"v": 44}
    os.write(a_to_b[1], (2 ** 31).to_bytes(4, "big"))  # a message over the size limit
    server.join(timeout=10)
    assert not server.is_alive()
    for fd in (*a_to_b, *b_to_a):
        os.close(fd)
    r, w = os.pipe()
    os.write(w, (5).to_bytes(4, "big") + b"[1,2]")
    os.write(w, (3).to_bytes(4, "big") + b"{1}")
    assert wire.recv(r) == [1, 2]
    with pytest.raises(wire.WireError, match="malformed"):
        wire.recv(r)
    os.close(w)
    with pytest.raises(wire.WireError, match="closed"):
        wire.recv(r)
    os.close(r)

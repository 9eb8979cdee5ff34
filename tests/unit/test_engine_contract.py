"""The engine contract (``megatron_rl/rollout/engine.py``): every engine class of the project, the
wrappers and the fakes in tests/helpers answers every member of ``ENGINE_CONTRACT`` itself or names
the default it keeps on purpose (``keeps_defaults``); the wrappers pass each member they do not
change to the engine they hold; the Ray client and actor split the contract between them."""
from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.rollout.actor import engine_actor
from megatron_rl.rollout.driver import ray_engine
from megatron_rl.rollout.driver.elastic import ElasticRollout
from megatron_rl.rollout.engine import ENGINE_CONTRACT, Completion, RolloutEngine, read_completions
from megatron_rl.rollout.engine_wrapper import ForwardingEngine, forwarded_members, forwards

REPO = Path(__file__).resolve().parents[2]
SEARCHED = ("megatron_rl", "rollpacker", "tests/helpers")
"""Where engine classes live (test modules' own narrow fakes are not held to the contract)."""


def _engine_classes() -> list[type]:
    """Every module-level class under SEARCHED deriving from RolloutEngine (read from the source, so
    a new implementation is checked without being listed here), imported."""
    defined: dict[str, list[tuple[str, list[str]]]] = {}
    for root in SEARCHED:
        for path in sorted((REPO / root).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.parse(path.read_text(), filename=str(path)).body:
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))]
                    defined.setdefault(module, []).append((node.name, bases))
    engines, grew = {"RolloutEngine"}, True
    while grew:  # subclasses of subclasses, by name
        before = len(engines)
        engines |= {name for classes in defined.values() for name, bases in classes if engines & set(bases)}
        grew = len(engines) > before
    found = [getattr(importlib.import_module(module), name) for module, classes in defined.items()
             for name, bases in classes if name in engines and name != "RolloutEngine"]
    return [cls for cls in found if issubclass(cls, RolloutEngine)]


ENGINE_CLASSES = _engine_classes()


def _default_kept(cls: type, name: str) -> bool:
    """``cls.<name>`` is the contract's own definition (a default, or an abstract member unanswered)."""
    return inspect.getattr_static(cls, name) is vars(RolloutEngine)[name]


def _contract_gaps(cls: type) -> list[str]:
    """What ``cls`` neither answers nor declares, and declarations that are not true."""
    kept = set(cls.keeps_defaults)
    gaps = [f"{cls.__name__}.{name} falls to RolloutEngine's default without being in keeps_defaults"
            for name in ENGINE_CONTRACT if _default_kept(cls, name) and name not in kept]
    for name in sorted(kept):
        if name not in ENGINE_CONTRACT:
            gaps.append(f"{cls.__name__}.keeps_defaults names {name!r}, not a member of the contract")
        elif getattr(vars(RolloutEngine)[name], "__isabstractmethod__", False):
            gaps.append(f"{cls.__name__}.keeps_defaults names {name!r}, which has no default")
        elif not _default_kept(cls, name):
            owner = next(k for k in cls.__mro__ if name in vars(k))
            gaps.append(f"{cls.__name__}.keeps_defaults names {name!r}, which {owner.__name__} answers")
    return gaps


def test_the_contract_is_every_public_member_of_the_interface_each_with_its_contract():
    public = [n for n, v in vars(RolloutEngine).items()
              if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))]
    assert list(ENGINE_CONTRACT) == public and len(public) >= 17
    undocumented = [n for n in public if len(inspect.getdoc(getattr(RolloutEngine, n)) or "") < 20]
    assert not undocumented, f"contract members without a docstring saying their contract: {undocumented}"


def test_every_engine_class_is_found():
    names = {cls.__name__ for cls in ENGINE_CLASSES}
    assert {"VLLMEngine", "RayEngineClient", "EnginePool", "ElasticRollout", "ForwardingEngine",
            "FakeEngine", "AnsweringEngine"} <= names, names


@pytest.mark.parametrize("cls", ENGINE_CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_engine_answers_every_member_or_names_the_default_it_keeps(cls):
    assert not _contract_gaps(cls), "\n".join(_contract_gaps(cls))


def test_the_check_fails_a_wrapper_that_keeps_a_default_silently():
    class Silent(ForwardingEngine):
        check_health = RolloutEngine.check_health  # what ElasticRollout resolved it to before the wrapper base

    class Stale(ForwardingEngine):
        keeps_defaults = frozenset({"sleep", "submit", "no_such_member"})

    assert _contract_gaps(Silent) == ["Silent.check_health falls to RolloutEngine's default without being in "
                                      "keeps_defaults"]
    assert _contract_gaps(Stale) == ["Stale.keeps_defaults names 'no_such_member', not a member of the contract",
                                     "Stale.keeps_defaults names 'sleep', which ForwardingEngine answers",
                                     "Stale.keeps_defaults names 'submit', which has no default"]


# ---------------------------------------------------------------- the forwards reach the held engine

class Recorder:
    """Stands for the held engine (or the Ray actor): records each member used and answers with a
    token naming it, so a test sees that the call, its arguments and its answer went through."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        kind = ENGINE_CONTRACT.get(name)
        if kind is None:
            raise AttributeError(name)
        if kind == "property":
            self.calls.append((name, ()))
            return f"answer-{name}"

        def member(*args: Any) -> Any:
            self.calls.append((name, args))
            if kind == "stream":
                return f"answer-{name}"
            future = asyncio.get_running_loop().create_future()
            future.set_result(f"answer-{name}")
            return future

        return member


def _arguments(name: str) -> tuple:
    """One distinct token per parameter of the contract member (its own defaults are not used)."""
    params = list(inspect.signature(getattr(RolloutEngine, name).fget if ENGINE_CONTRACT[name] == "property"
                                    else getattr(RolloutEngine, name)).parameters)[1:]
    return tuple(f"{name}-{p}" for p in params)


async def _use(obj: Any, name: str) -> Any:
    kind = ENGINE_CONTRACT[name]
    if kind == "property":
        return getattr(obj, name)
    result = getattr(obj, name)(*_arguments(name))
    return await result if kind == "call" else result


def _wrappers(inner: Recorder) -> list[RolloutEngine]:
    async def no_factory(*args):
        raise AssertionError("not used")

    return [ForwardingEngine(inner), ElasticRollout(inner, 1, no_factory)]


@pytest.mark.parametrize("index", range(2), ids=["ForwardingEngine", "ElasticRollout"])
def test_a_wrapper_passes_each_member_it_does_not_change_to_the_held_engine(index):
    async def main() -> list[str]:
        inner = Recorder()
        wrapper = _wrappers(inner)[index]
        forwarded = forwarded_members(type(wrapper))
        wrong = []
        for name in forwarded:
            inner.calls.clear()
            answer = await _use(wrapper, name)
            if answer != f"answer-{name}" or inner.calls != [(name, _arguments(name))]:
                wrong.append(f"{name}: answered {answer!r}, held engine saw {inner.calls}")
        assert len(forwarded) >= 8, forwarded
        return wrong

    wrong = asyncio.run(main())
    assert not wrong, "\n".join(wrong)


def test_the_elastic_wrapper_forwards_supervision_to_the_engines_it_holds_now():
    """The loop hands its restorer and its recovery to the one engine object it holds: through
    the elastic wrapper they reach the current pool (no supervisor reference beside the engine)."""
    forwarded = set(forwarded_members(ElasticRollout))
    assert {"supervise", "recover", "check_health"} <= forwarded, forwarded


# ---------------------------------------------------------------- across the Ray actor boundary

def test_the_ray_client_and_actor_split_the_contract_between_them():
    remote, local = set(engine_actor.REMOTE_MEMBERS), set(engine_actor.ANSWERED_BY_THE_CLIENT)
    assert remote | local == set(ENGINE_CONTRACT) and not remote & local
    assert all(ENGINE_CONTRACT[n] == "call" for n in remote), "only coroutine calls cross the actor boundary"
    assert all(engine_actor.ANSWERED_BY_THE_CLIENT.values())  # each says why it stays on the driver
    for name in remote:
        assert inspect.iscoroutinefunction(getattr(engine_actor.EngineActor, name)), f"EngineActor.{name}"
    for name in local:
        assert name not in forwarded_members(ray_engine.RayEngineClient), name
        assert not _default_kept(ray_engine.RayEngineClient, name) or name in ray_engine.RayEngineClient.keeps_defaults


class _Actor:
    """A Ray actor handle as the client uses it: ``actor.<method>.remote(*args)`` gives an awaitable."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return type("Method", (), {"remote": staticmethod(getattr(self._recorder, name))})()


def test_the_ray_client_makes_each_remote_member_one_actor_call_and_the_actor_forwards_it():
    async def main():
        recorder = Recorder()
        client = ray_engine.RayEngineClient(_Actor(recorder), tensor_parallel_size=2)
        actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)  # no vLLM: only the forwards
        actor._engine = recorder
        by_client = forwarded_members(ray_engine.RayEngineClient)
        by_actor = forwarded_members(engine_actor.EngineActor)
        assert {"submit", "abort", "stats", "sleep", "receive_weights"} <= set(by_client)
        assert {"abort", "stats", "receive_weights"} <= set(by_actor)  # (sleep: answered, it holds a fault point)
        for obj, names in ((client, by_client), (actor, by_actor)):
            for name in names:
                recorder.calls.clear()
                assert await _use(obj, name) == f"answer-{name}"
                assert recorder.calls == [(name, _arguments(name))], (type(obj).__name__, name)
        assert client.tensor_parallel_size == 2 and client.active_engines == 1  # answered on the driver
        with pytest.raises(ValueError, match="RayEngineClient runs a single engine"):
            await client.release_engines(1)

    asyncio.run(main())


def test_forwards_refuses_what_it_cannot_forward():
    with pytest.raises(TypeError, match="'not_a_member' is not a member of the engine contract"):
        forwards(["not_a_member"])(type("X", (), {}))
    with pytest.raises(TypeError, match="contract stream 'completions' cannot be forwarded as a call"):
        forwards(["completions"], call=lambda name: None)(type("Y", (), {}))


# ---------------------------------------------------------------- the one queue reader of the pumps

def test_the_queue_reader_yields_completions_and_raises_a_failure_kept_for_the_next_reader_when_asked():
    async def main():
        done = Completion("a", [1], [-0.1], "stop", 0)
        for keep in (False, True):
            queue: asyncio.Queue = asyncio.Queue()
            for item in (done, RuntimeError("engine died")):
                queue.put_nowait(item)
            reader = read_completions(queue, keep_failure=keep)
            assert await reader.__anext__() is done
            with pytest.raises(RuntimeError, match="engine died"):
                await reader.__anext__()
            assert queue.qsize() == int(keep)

    asyncio.run(main())

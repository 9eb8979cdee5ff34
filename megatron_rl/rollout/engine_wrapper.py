"""One wrapper base for engines that hold another engine: the contract forwarded in one place.

:class:`ForwardingEngine` forwards every member of :data:`engine.ENGINE_CONTRACT` to the engine it
holds, so a wrapper (elastic TP, restarts) overrides only what it changes, and a member added to
the contract is forwarded by every wrapper without another edit. :func:`forwards` installs the
forwards; the Ray client and actor (``ray_engine``) use it too, with the members that cross the
actor boundary and, on the client, a remote call in place of the local one.
"""
from __future__ import annotations

import abc
import inspect
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from megatron_rl.rollout.engine import ENGINE_CONTRACT, RolloutEngine

C = TypeVar("C", bound=type)

FORWARD_MARK = "__engine_forward__"
"""Attribute set on every forward :func:`forwards` installs (a property's getter included), so a forward
is told apart from a member the class answers itself (:func:`forwarded_members`)."""

CallMaker = Callable[[str], Callable[..., Awaitable[Any]]]
"""``make(name)``: the coroutine function (taking ``self`` and the member's arguments) that answers
contract call ``name``."""


def _to_inner(name: str) -> Callable[..., Awaitable[Any]]:
    async def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = await self._forward_target()
        return await getattr(target, name)(*args, **kwargs)

    return forward


def _stream_to_inner(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._engine, name)(*args, **kwargs)

    return forward


def _dressed(function: Callable[..., Any], cls: type, name: str) -> Callable[..., Any]:
    """``function`` named, documented and signed like the contract's member (Ray checks actor call
    arguments against the signature). Not ``functools.wraps``: it would copy the abstract mark."""
    contract = getattr(RolloutEngine, name)
    contract = contract.fget if isinstance(contract, property) else contract
    function.__name__ = name
    function.__qualname__ = f"{cls.__qualname__}.{name}"
    function.__doc__ = f"Forwarded. {contract.__doc__ or ''}".rstrip()
    function.__signature__ = inspect.signature(contract)  # type: ignore[attr-defined]
    function.__module__ = cls.__module__
    setattr(function, FORWARD_MARK, True)
    return function


def forwards(members: Iterable[str], call: CallMaker | None = None) -> Callable[[C], C]:
    """Class decorator: give the class a forward for each of ``members`` (contract member names)
    that its own body does not define.

    A call goes to ``await self._forward_target()``, or is made by ``call(name)`` when given (the
    Ray client: a remote call). A stream or property goes to ``self._engine``, read at each use
    (a wrapper that replaces its engine forwards to the new one); with ``call`` given there is no
    local engine, so such a member must be answered in the class body.
    """
    names = list(members)

    def install(cls: C) -> C:
        for name in names:
            kind = ENGINE_CONTRACT.get(name)
            if kind is None:
                raise TypeError(f"{cls.__name__}: {name!r} is not a member of the engine contract")
            if name in vars(cls):
                continue  # the class answers it itself
            if kind == "call":
                setattr(cls, name, _dressed((call or _to_inner)(name), cls, name))
            elif call is not None:
                raise TypeError(f"{cls.__name__}: contract {kind} {name!r} cannot be forwarded as a call; "
                                "answer it in the class body")
            elif kind == "stream":
                setattr(cls, name, _dressed(_stream_to_inner(name), cls, name))
            else:
                getter = _dressed(lambda self, _name=name: getattr(self._engine, _name), cls, name)
                setattr(cls, name, property(getter, doc=getter.__doc__))
        abc.update_abstractmethods(cls)  # the forwards answer the contract's abstract members
        return cls

    return install


def forwarded_members(cls: type) -> list[str]:
    """The contract members ``cls`` forwards (installed by :func:`forwards`, here or in a base class)
    rather than answering itself."""
    def is_forward(member: object) -> bool:
        return getattr(member.fget if isinstance(member, property) else member, FORWARD_MARK, False)

    return [name for name in ENGINE_CONTRACT if is_forward(inspect.getattr_static(cls, name, None))]


@forwards(ENGINE_CONTRACT)
class ForwardingEngine(RolloutEngine):
    """A :class:`RolloutEngine` over another one: every contract member is forwarded to the held
    engine; subclasses override what they change (and call the held engine themselves there)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self._engine = engine

    @property
    def engine(self) -> RolloutEngine:
        """The engine(s) held now (a wrapper may replace them: a restart, a TP switch)."""
        return self._engine

    async def _forward_target(self) -> RolloutEngine:
        """The engine a forwarded call goes to (a restarting wrapper first waits for a replacement
        under way)."""
        return self._engine

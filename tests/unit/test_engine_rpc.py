"""VLLMEngine._rpc: a call into an engine core that dies while the call waits fails with the
engine's dead error within a poll, instead of waiting for an answer that never comes."""
from __future__ import annotations

import asyncio
import time

import pytest

from megatron_rl.rollout.actor import vllm_engine
from megatron_rl.rollout.actor.vllm_engine import VLLMEngine


class _DeadError(RuntimeError):
    pass


class _FakeLLM:
    """What _rpc reads of vLLM's AsyncLLM: ``errored`` and ``dead_error``."""

    def __init__(self) -> None:
        self.errored = False
        self.dead_error = _DeadError("engine core died")


def _engine() -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only _rpc's own logic is under test
    engine._llm = _FakeLLM()
    return engine


def test_a_call_answered_returns_its_result() -> None:
    async def answered() -> int:
        await asyncio.sleep(0.05)
        return 7

    assert asyncio.run(_engine()._rpc(answered())) == 7


def test_a_call_whose_core_dies_fails_within_a_poll_and_is_cancelled(monkeypatch) -> None:
    monkeypatch.setattr(vllm_engine, "DEATH_POLL_S", 0.05)
    engine = _engine()
    cancelled = asyncio.Event()

    async def never_answered() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> float:
        async def die_soon() -> None:
            await asyncio.sleep(0.2)
            engine._llm.errored = True

        killer = asyncio.ensure_future(die_soon())
        start = time.monotonic()
        with pytest.raises(_DeadError, match="engine core died"):
            await engine._rpc(never_answered())
        elapsed = time.monotonic() - start
        await asyncio.sleep(0)  # let the cancelled call run its handler
        await killer
        return elapsed

    elapsed = asyncio.run(scenario())
    assert 0.2 <= elapsed < 2.0, elapsed
    assert cancelled.is_set(), "the call into the dead core was left pending"


def test_an_error_of_the_call_itself_propagates() -> None:
    async def refused() -> None:
        raise ValueError("refused by the engine")

    with pytest.raises(ValueError, match="refused by the engine"):
        asyncio.run(_engine()._rpc(refused()))

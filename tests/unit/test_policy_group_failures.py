"""PolicyGroup when a trainer rank dies, fails or hangs: the call ends a grace period after the
first failure with an error naming every rank concerned, and the group refuses further calls;
an error every rank raised alike (a refused batch) passes through and leaves the group whole.

The ranks here are stand-ins for Ray actor handles (``call.remote`` returns an awaitable, as a
real ObjectRef is); tests/integration/test_faults.py kills real ranks."""
from __future__ import annotations

import asyncio

import pytest
import ray

from megatron_rl.training import policy_group
from megatron_rl.training.policy_group import PolicyGroup, TrainerRankError, TrainerRankTimeout


class _Rank:
    """``behaviour``: 'ok' answers, 'dies' fails as a dead actor, 'refuses' raises ValueError,
    'hangs' never answers; each after ``delay_s``."""

    def __init__(self, rank: int, behaviour: str, delay_s: float = 0.01) -> None:
        self.rank, self.behaviour, self.delay_s = rank, behaviour, delay_s
        self.calls: list[str] = []

    @property
    def call(self):
        rank = self

        class _Call:
            @staticmethod
            def remote(name, *args):
                rank.calls.append(name)
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                if rank.behaviour == "ok":
                    loop.call_later(rank.delay_s, future.set_result, rank.rank)
                elif rank.behaviour == "dies":
                    loop.call_later(rank.delay_s, future.set_exception, ray.exceptions.ActorDiedError())
                elif rank.behaviour == "refuses":
                    loop.call_later(rank.delay_s, future.set_exception, ValueError("bad batch"))
                return future

        return _Call


def _group(*behaviours: str) -> PolicyGroup:
    group = object.__new__(PolicyGroup)  # no Ray: only the call plumbing
    group.actors = [_Rank(r, b) for r, b in enumerate(behaviours)]
    group.where = [f"pid {100 + r} on node n{r}" for r in range(len(behaviours))]
    group.broken, group._in_flight, group._ranks = "", {}, []
    return group


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(policy_group, "PEER_GRACE_S", 0.2)


def test_a_dead_rank_and_the_one_waiting_for_it_are_named_and_the_group_is_broken():
    group = _group("hangs", "dies")  # rank 0 blocked in a collective with the dead rank 1
    with pytest.raises(TrainerRankError) as info:
        asyncio.run(group.train_step(["s"]))
    message = str(info.value)
    assert "during train_step (2 ranks)" in message
    assert "rank 1 (pid 101 on node n1) died: ActorDiedError" in message
    assert "rank 0 (pid 100 on node n0) gave no answer within 0.2 s after the failure" in message
    assert group.broken and 0 in group._in_flight  # rank 0 may still be running it
    with pytest.raises(TrainerRankError, match="refused, the group is broken"):
        asyncio.run(group.compute_logprobs(["s"]))
    assert group.actors[1].calls == ["train_step"]  # nothing more was sent


def test_an_error_every_rank_raised_passes_through_and_the_group_stays_whole():
    group = _group("refuses", "refuses")
    with pytest.raises(ValueError, match="bad batch"):
        asyncio.run(group.train_step(["s"]))
    assert not group.broken
    for rank in group.actors:
        rank.behaviour = "ok"
    assert asyncio.run(group.train_step(["s"])) == 0


def test_ranks_that_never_answer_time_out_naming_them(monkeypatch):
    monkeypatch.setattr(policy_group, "CALL_TIMEOUT_S", 0.1)
    group = _group("ok", "hangs")
    with pytest.raises(TrainerRankTimeout, match=r"rank 1 \(pid 101 on node n1\) gave no answer within 0.1 s in all"):
        asyncio.run(group.save_checkpoint("/tmp/x"))
    assert isinstance(TrainerRankTimeout("x"), TimeoutError)  # what callers of a timed-out call catch

"""Cancelling reward work (e.g. after a scheduler aborts requests): results dropped, workers told.

Contract of :func:`cancel`: every handle not yet done or cancelled is marked cancelled (its
outcome is never applied: the sample's reward, raw_reward and correct stay as they were) and counted
once in ``reward/cancelled``, never as an error or timeout. Each owning Ray worker gets one
``skip`` call (fire-and-forget) listing its tasks among these; it runs in the actor's control
concurrency group (:data:`~megatron_rl.reward.pool.worker.CONTROL_GROUP`), beside the scoring thread.
A task still queued then returns a 'cancelled' outcome as soon as its turn comes, without
scoring; a code-sandbox run in progress is killed (a math reward in progress, bounded by
``reward.timeout_s``, runs to its end). Until a task returns it counts as its worker's load.
Handles already done, or already cancelled, are left as they are (no second skip).

The tasks are deliberately not ``ray.cancel``-ed: a reward worker is an ordered (sequential)
actor, and cancelling a task its caller has not pushed to the actor yet (tail batching cancels
responses it accepted moments before) leaves a hole in the actor's sequence numbers. The actor
then waits 30 s for the missing task and fails every task queued behind it, which scored a
whole step with ``timeout_reward``.
"""
from __future__ import annotations

import logging

from megatron_rl.reward.pool.handles import RewardHandle
from megatron_rl.reward.pool.metrics import RewardStats
from megatron_rl.reward.pool.worker import CONTROL_GROUP
from megatron_rl.reward.pool.worker_set import WorkerSet

logger = logging.getLogger(__name__)


def cancel(handles: list[RewardHandle], workers: WorkerSet, stats: RewardStats) -> None:
    """Drop these responses and ask their workers to skip them (see the module docstring)."""
    by_worker: dict[int, list[int]] = {}
    for handle in handles:
        if handle.done or handle.cancelled:
            continue
        handle.cancelled = True
        stats.cancelled += 1
        if handle.ref is not None and handle.task_id is not None and handle.worker in workers.actors:
            by_worker.setdefault(handle.worker, []).append(handle.task_id)
    for wid, task_ids in by_worker.items():
        try:
            workers.actors[wid].skip.options(concurrency_group=CONTROL_GROUP).remote(task_ids)
        except Exception as exc:  # noqa: BLE001 - a dead worker: its tasks fail (and are dropped) anyway
            logger.debug("reward worker #%d: skip of %d tasks not sent: %s", wid, len(task_ids), exc)

"""The reward worker: decode a response, grade it with the rule its prompt needs, shape by length.

Plain class; the reward pool's :class:`~megatron_rl.reward.pool.worker_set.WorkerSet` wraps it as a
Ray actor or uses it in-process. Routing (``reward.kind``): 'math' and 'code' send every
response to that rule; 'mixed' sends prompts whose ``metadata['format']`` is a code format (see
``code_reward.CODE_FORMATS``) to the code sandbox and the rest to math-verify; 'judge' is scored
on the driver by the LLM judge (the pool never sends those here).

Cooperative cancellation: as a Ray actor the worker has a second concurrency group,
:data:`CONTROL_GROUP` (one thread), next to the default one that runs ``score`` calls one at a
time in submission order. :meth:`RewardWorker.skip` runs there, so it takes effect while scoring
goes on: a listed task that has not started yet returns a 'cancelled' outcome at once when its
turn comes, and a code-sandbox run in progress is killed. (``ray.cancel`` is not used on these
ordered actor tasks: see :mod:`~megatron_rl.reward.pool.cancellation`.)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from megatron_rl.algorithms.shaping import shaped_reward
from megatron_rl.config.schema import AlgorithmConfig, RewardConfig
from megatron_rl.reward.graders.code_reward import CODE_FORMATS, CodeReward
from megatron_rl.reward.graders.math_reward import MathReward
from megatron_rl.reward.graders.result import RewardResult
from megatron_rl.reward.pool.response_decoder import load_response_decoder

logger = logging.getLogger(__name__)

REWARD_KINDS = ("math", "code", "mixed", "judge")
CONTROL_GROUP = "control"
"""Ray concurrency group of the worker's control calls (:meth:`RewardWorker.skip`)."""


def route_for(kind: str, metadata: dict | None) -> str:
    """Which rule scores a prompt's responses: 'math', 'code' or 'judge'."""
    if kind == "mixed":
        return "code" if (metadata or {}).get("format") in CODE_FORMATS else "math"
    return kind


@dataclass
class RewardOutcome:
    """What a worker reports for one response."""

    raw_reward: float
    """Rule reward before shaping (``timeout_reward`` on timeout/failure)."""
    reward: float
    """Reward after overlong shaping: what advantages use."""
    correct: bool
    """Whether the answer matched the ground truth (code: every test passed)."""
    extracted: str
    """The answer (or code) found in the response ('' if none)."""
    status: str
    """'ok', 'no_answer', 'timeout' or 'error' (see ``RewardResult.status``), or 'cancelled'
    (skipped or stopped by :meth:`RewardWorker.skip`; the pool has already dropped it)."""
    detail: str
    """Why a non-'ok' status happened, or the first failing test."""
    elapsed_s: float
    """Seconds the worker spent scoring (decode + grade)."""
    source: str = "math"
    """Rule that scored it: 'math', 'code' or 'judge'."""
    run_s: float = 0.0
    """Seconds the grader itself ran (code: the sandbox run; feeds adaptive timeouts)."""


def make_outcome(result: RewardResult, source: str, num_tokens: int, max_new_tokens: int,
                 algo: AlgorithmConfig, elapsed_s: float) -> RewardOutcome:
    """Apply DAPO overlong shaping to a rule result."""
    reward = shaped_reward(result.reward, num_tokens, max_new_tokens, algo.overlong_buffer_tokens,
                           algo.overlong_penalty)
    return RewardOutcome(result.reward, reward, result.correct, result.extracted, result.status,
                         result.detail, elapsed_s, source, result.elapsed_s)


class RewardWorker:
    """Scores responses: decode tokens, grade (math or code), shape by length."""

    def __init__(self, reward_cfg: RewardConfig, tokenizer_path: str, max_new_tokens: int,
                 algorithm_cfg: AlgorithmConfig | None = None, eager_start: bool = True) -> None:
        """``eager_start`` starts the math grading process now rather than on the first response."""
        if reward_cfg.kind not in REWARD_KINDS:
            raise ValueError(f"reward.kind={reward_cfg.kind!r}: expected one of {REWARD_KINDS}")
        try:
            self._decoder = load_response_decoder(tokenizer_path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward worker cannot load the tokenizer from {tokenizer_path!r}: {exc}") from exc
        self._cfg = reward_cfg
        self._algo = algorithm_cfg or AlgorithmConfig()
        self._max_new_tokens = max_new_tokens
        # Surface a bad shaping config at start-up, not on the first response.
        shaped_reward(0.0, 0, max_new_tokens, self._algo.overlong_buffer_tokens, self._algo.overlong_penalty)
        self._math = self._code = None
        if reward_cfg.kind in ("math", "mixed"):
            self._math = MathReward(reward_cfg.timeout_s, reward_cfg.timeout_reward)
            if eager_start:
                self._math.start()
        if reward_cfg.kind in ("code", "mixed"):
            self._code = CodeReward(reward_cfg.code_timeout_max_s, reward_cfg.timeout_reward,
                                    reward_cfg.sandbox_memory_mb, reward_cfg.sandbox_isolation,
                                    reward_cfg.sandbox_disk_mb)
        # Cancellation state, shared by the scoring thread and the control thread.
        self._lock = threading.Lock()
        self._skip: set[int] = set()
        self._running: tuple[int, threading.Event] | None = None
        self._last_started = -1
        self.cancel_counts = {"skipped": 0, "stopped": 0, "finished": 0}
        """Cancelled tasks: answered without running ('skipped'), sandbox runs cut short
        ('stopped'), and ones cancelled while running that ran to the end anyway ('finished':
        math rewards, bounded by ``reward.timeout_s``)."""

    def score(self, response_ids: list[int], ground_truth: str, label: str = "",
              metadata: dict | None = None, timeout_s: float | None = None,
              task_id: int | None = None) -> RewardOutcome:
        """Score one response given its token ids, the prompt's ground truth and metadata.

        ``label`` (e.g. 'prompt_id#index') only names the response in warnings; ``timeout_s``
        overrides the code reward's limit (the pool's adaptive timeout). ``task_id`` (the pool
        numbers its tasks in increasing order) lets :meth:`skip` cancel this call.
        """
        start = time.monotonic()
        source = route_for(self._cfg.kind, metadata)
        cancel = None
        if task_id is not None:
            with self._lock:
                self._last_started = max(self._last_started, task_id)
                if self._skip:
                    skipped = task_id in self._skip
                    # Tasks run in submission order: ids up to this one will never start again.
                    self._skip = {t for t in self._skip if t > task_id}
                    if skipped:
                        self.cancel_counts["skipped"] += 1
                        return self._cancelled(source, "skipped before it ran", start)
                cancel = threading.Event()
                self._running = (task_id, cancel)
        try:
            text = self._decoder.decode(response_ids)
            if source == "code" and self._code is not None:
                result = self._code(text, ground_truth, metadata, timeout_s, cancel)
            elif source == "math" and self._math is not None:
                result = self._math(text, ground_truth)  # short (reward.timeout_s): left to finish
            else:
                raise ValueError(f"reward worker of kind {self._cfg.kind!r} cannot score {source!r} responses "
                                 f"({label or 'a response'})")
        finally:
            if cancel is not None:
                with self._lock:
                    self._running = None
        if cancel is not None and cancel.is_set():
            stopped = result.status == "cancelled"
            with self._lock:
                self.cancel_counts["stopped" if stopped else "finished"] += 1
            return self._cancelled(source, "stopped while running" if stopped else
                                   "cancelled while running; it ran to the end", start)
        if result.status in ("timeout", "error"):
            logger.warning("%s reward %s for %s: %s", source, result.status, label or "a response", result.detail)
        return make_outcome(result, source, len(response_ids), self._max_new_tokens, self._algo,
                            time.monotonic() - start)

    def skip(self, task_ids: list[int]) -> int:
        """Cancel these tasks (a control call: on a Ray actor it runs in :data:`CONTROL_GROUP`,
        beside a running ``score``). One that has not started answers 'cancelled' without scoring
        when its turn comes; a code-sandbox run in progress is killed; ids of tasks that already
        finished are ignored. Returns how many tasks this affects (queued + running)."""
        with self._lock:
            ids = set(task_ids)
            affected = 0
            if self._running is not None and self._running[0] in ids:
                self._running[1].set()
                affected += 1
            queued = {t for t in ids if t > self._last_started}
            self._skip |= queued
            return affected + len(queued)

    def _cancelled(self, source: str, detail: str, start: float) -> RewardOutcome:
        return RewardOutcome(0.0, 0.0, False, "", "cancelled", detail, time.monotonic() - start, source)

    def cancel_stats(self) -> dict[str, int]:
        """``cancel_counts`` plus how many skip requests wait for their task (a control call)."""
        with self._lock:
            return dict(self.cancel_counts, pending_skips=len(self._skip))

    def ping(self) -> bool:
        """Liveness check (returns True once the worker is constructed)."""
        return True

    def close(self) -> None:
        """Stop the math grading process (sandbox runs end with each call)."""
        if self._math is not None:
            self._math.close()

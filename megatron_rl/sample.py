"""The record that carries one response through the whole pipeline.

rollout -> reward -> advantages -> batch -> logprobs -> train step. Plain data, picklable, so it
crosses Ray boundaries unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prompt:
    """One prompt of a dataset, already tokenised with the chat template."""

    prompt_id: str
    """Stable id: '<dataset>:<row>' for files, 'arith:<index>' for the built-in task."""
    token_ids: list[int]
    """Prompt tokens including the chat template."""
    answer: str
    """Ground truth for the reward function."""
    text: str = ""
    """The question text before templating (for logs)."""
    metadata: dict = field(default_factory=dict)
    """Dataset-specific extras (e.g. tests for code tasks)."""


@dataclass
class Sample:
    """One response to one prompt, plus everything learned about it on the way."""

    prompt: Prompt
    """The prompt this response answers."""
    response_index: int
    """Index within the prompt's group (0 .. R-1)."""
    request_id: str = ""
    """Engine request id."""
    response_ids: list[int] = field(default_factory=list)
    """Generated tokens (no prompt)."""
    engine_logprobs: list[float] = field(default_factory=list)
    """Per-token logprobs reported by the engine when sampling."""
    finish_reason: str = ""
    """'stop', 'length' or 'abort'."""
    policy_version: int = -1
    """Trainer step whose weights generated this response (its newest tokens, for a response
    continued across steps)."""
    token_versions: list[int] = field(default_factory=list)
    """Policy version that generated each response token (``loop.requests.accept_completion`` records
    it). A response continued across steps (a partial rollout) holds several. Empty: every token
    is of ``policy_version``."""
    round_type: str = "baseline"
    """Which scheduling round produced it (baseline, short, long)."""
    reward: float | None = None
    """Scalar reward (after shaping) once scored."""
    raw_reward: float | None = None
    """Reward before overlong shaping."""
    correct: bool | None = None
    """Whether the answer matched the ground truth."""
    advantage: float = 0.0
    """Group-normalised advantage (same for every token of the response)."""
    old_logprobs: list[float] = field(default_factory=list)
    """Trainer logprobs of the response under the generating policy."""
    ref_logprobs: list[float] = field(default_factory=list)
    """Reference-model logprobs (when a KL term is used)."""
    staleness: list[int] = field(default_factory=list)
    """Per response token: how many versions the policy that generated it lags behind the one
    being trained. Set by the loop before training, and only when some token of the batch is
    stale (``megatron_rl.loop.off_policy``); empty means every token is on-policy."""
    timings: dict = field(default_factory=dict)
    """Wall-clock stamps: submitted, finished, reward_done (seconds, time.monotonic())."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.token_ids) + len(self.response_ids)

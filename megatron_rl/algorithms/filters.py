"""Group filters applied between reward and training.

DAPO's dynamic sampling drops groups whose responses are all right or all wrong (the rule reward
has zero variance): such a group carries no signal about correctness, costs a forward/backward
pass and only dilutes the token-mean loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.sample import Sample


@dataclass
class FilterResult:
    """Groups split by a filter, in their input order."""

    kept: list[list[Sample]] = field(default_factory=list)
    """Groups that go on to training."""
    filtered: list[list[Sample]] = field(default_factory=list)
    """Groups that were dropped."""

    @property
    def num_filtered(self) -> int:
        """How many groups were dropped."""
        return len(self.filtered)

    @property
    def num_kept(self) -> int:
        """How many groups were kept."""
        return len(self.kept)


def is_zero_variance(group: list[Sample], atol: float = 1e-9) -> bool:
    """True when every response of ``group`` has the same rule reward (within ``atol``).

    The rule reward (``raw_reward``: correct or not, before DAPO's overlong shaping) is what
    DAPO's dynamic sampling filters on (its accuracy metric): an all-wrong group whose shaped
    rewards differ only by the overlong penalty carries no signal about correctness, and training
    on it would teach length alone. Samples without a ``raw_reward`` (scorers that do no
    shaping) are compared by ``reward``.

    Raises ValueError naming the response if a reward is missing (not yet scored).
    """
    rewards = []
    for sample in group:
        value = sample.raw_reward if sample.raw_reward is not None else sample.reward
        if value is None:
            raise ValueError(
                f"sample {sample.prompt.prompt_id}#{sample.response_index} has no reward yet; "
                "score every response of a group before filtering it"
            )
        rewards.append(value)
    # A group of one carries no comparison signal either: it is zero-variance by definition.
    return max(rewards) - min(rewards) <= atol


def filter_zero_variance(groups: list[list[Sample]], atol: float = 1e-9) -> FilterResult:
    """Split ``groups`` into those with reward spread (kept) and those without (filtered)."""
    result = FilterResult()
    for group in groups:
        if not group:
            raise ValueError("empty group passed to filter_zero_variance")
        (result.filtered if is_zero_variance(group, atol) else result.kept).append(group)
    return result

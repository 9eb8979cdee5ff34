"""Outcome advantage estimators for group-sampled RL (GRPO family).

Every response of a prompt forms a group; a response's advantage compares its reward with the
group's, and the same scalar is used for every token of the response.

* ``grpo``:   A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction (n - 1), as
  in veRL and TRL.
* ``drgrpo``: A_i = r_i - mean(r) (Dr.GRPO, "Understanding R1-Zero-Like Training": dividing by
  the std over-weights groups that are almost all right or all wrong).

A group of one response gets advantage 0: with no sibling there is no baseline to compare with.
"""
from __future__ import annotations

import math

from megatron_rl.sample import Sample

ADVANTAGE_KINDS = ("grpo", "drgrpo")


def group_advantages(rewards: list[float], kind: str = "grpo", eps: float = 1e-6) -> list[float]:
    """Advantages of one group's ``rewards`` (see the module docstring for the formulas)."""
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"algorithm.advantage={kind!r}: expected one of {ADVANTAGE_KINDS}")
    n = len(rewards)
    if n == 0:
        return []
    if n == 1:
        return [0.0]
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if kind == "drgrpo":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def group_by_prompt(samples: list[Sample]) -> list[list[Sample]]:
    """Group samples by ``prompt.prompt_id``, groups in order of first appearance."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.prompt.prompt_id, []).append(sample)
    return list(groups.values())


def compute_advantages(samples: list[Sample], kind: str = "grpo", eps: float = 1e-6) -> None:
    """Set ``Sample.advantage`` on every sample, grouping by prompt id.

    Every sample must already carry its (shaped) ``reward``; a missing one is an error naming
    the response, because silently treating it as 0 would bias the whole group.
    """
    for group in group_by_prompt(samples):
        rewards = []
        for sample in group:
            if sample.reward is None:
                raise ValueError(
                    f"sample {sample.prompt.prompt_id}#{sample.response_index} has no reward; "
                    "every response must be scored before advantages are computed"
                )
            rewards.append(float(sample.reward))
        for sample, advantage in zip(group, group_advantages(rewards, kind, eps)):
            sample.advantage = advantage

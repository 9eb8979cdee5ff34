"""Adaptive per-problem timeouts for code rewards (RollPacker's reward scheduler).

A fixed timeout is either too short for slow-but-correct problems (false negatives) or lets a
wrong solution stuck in a loop hold a worker for the full budget. The timeout of a problem is

    T = min(max(T_min, lambda * T_anchor), T_max)

where ``T_anchor`` is the slowest run time seen among *correct* responses to that problem
(online: it only grows as slower correct solutions appear), or a dataset-provided anchor (e.g.
the reference solution's run time) when no correct response has been seen yet. With neither,
the problem gets ``T_max``. The table lives on the driver (in the reward pool), so every
worker uses the same anchors.
"""
from __future__ import annotations

from dataclasses import dataclass

ANCHOR_METADATA_KEYS = ("time_anchor_s", "reference_time_s")
"""Prompt metadata keys read as a dataset-provided anchor (seconds), first found wins."""


@dataclass
class TimeoutPolicy:
    """The three constants of the rule."""

    scale: float = 1.5
    """lambda: headroom over the anchor."""
    min_s: float = 2.0
    """T_min: lower bound (start-up noise, tiny problems)."""
    max_s: float = 30.0
    """T_max: upper bound, and the timeout of problems with no anchor."""

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_s <= 0 or self.max_s < self.min_s:
            raise ValueError(f"adaptive timeout needs scale > 0 and 0 < min_s <= max_s, got "
                             f"scale={self.scale}, min_s={self.min_s}, max_s={self.max_s}")

    def clamp(self, anchor_s: float) -> float:
        """min(max(T_min, lambda * anchor), T_max)."""
        return min(max(self.min_s, self.scale * anchor_s), self.max_s)


def dataset_anchor(metadata: dict | None) -> float | None:
    """The anchor a dataset row provides (see ``ANCHOR_METADATA_KEYS``), if any and positive."""
    for key in ANCHOR_METADATA_KEYS:
        value = (metadata or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


class AdaptiveTimeouts:
    """Per-problem timeouts from online anchors (slowest correct run) or dataset anchors."""

    def __init__(self, policy: TimeoutPolicy | None = None) -> None:
        self.policy = policy or TimeoutPolicy()
        self._anchors: dict[str, float] = {}

    def anchor(self, problem_id: str, metadata: dict | None = None) -> float | None:
        """The online anchor of a problem, else its dataset anchor, else None."""
        online = self._anchors.get(problem_id)
        return online if online is not None else dataset_anchor(metadata)

    def timeout_s(self, problem_id: str, metadata: dict | None = None) -> float:
        """Timeout for the next response to ``problem_id``."""
        anchor = self.anchor(problem_id, metadata)
        return self.policy.max_s if anchor is None else self.policy.clamp(anchor)

    def observe(self, problem_id: str, run_s: float, correct: bool) -> None:
        """Record a finished run: a correct one raises the problem's anchor to its run time."""
        if correct and run_s > 0:
            self._anchors[problem_id] = max(run_s, self._anchors.get(problem_id, 0.0))

    def __len__(self) -> int:
        return len(self._anchors)

    def state_dict(self) -> dict:
        """Online anchors (to keep across a resume)."""
        return {"anchors": dict(self._anchors)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self._anchors = {str(k): float(v) for k, v in state.get("anchors", {}).items()}

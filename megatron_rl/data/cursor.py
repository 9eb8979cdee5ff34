"""Epoch-based, resumable iteration over prompt indices.

Every epoch visits each prompt exactly once, in an order seeded by ``seed + epoch``. The state
is two integers plus a short list, so a checkpoint restores the cursor exactly: a resumed run
neither loses nor repeats a prompt within an epoch.
"""
from __future__ import annotations

import numpy as np


class PromptCursor:
    """Hands out prompt indices ``take(n)`` at a time, epoch after epoch.

    A batch may straddle an epoch boundary (the end of one epoch, then the start of the next).
    Prompts already in that batch are moved to the back of the new epoch's order, so one batch
    never holds the same prompt twice as long as ``n <= num_prompts`` (schedulers may key
    groups by prompt id).
    """

    def __init__(self, num_prompts: int, seed: int, shuffle: bool = True) -> None:
        if num_prompts <= 0:
            raise ValueError(f"PromptCursor needs at least one prompt, got num_prompts={num_prompts}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        """Prompts of the current epoch already handed out."""
        self._deferred: list[int] = []
        """Prompts moved to the back of this epoch because the straddling batch held them."""
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.num_prompts)
        else:
            order = np.arange(self.num_prompts)
        if self._deferred:
            deferred = np.isin(order, self._deferred)
            order = np.concatenate([order[~deferred], order[deferred]])
        return order

    def take(self, n: int) -> list[int]:
        """The next ``n`` prompt indices (continuing into the next epoch when this one ends)."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            if self.position == self.num_prompts:
                self.epoch += 1
                self.position = 0
                # Only the part of this batch that came from the old epoch can repeat.
                self._deferred = list(out)
                self._order = self._epoch_order()
            chunk = self._order[self.position : self.position + n - len(out)]
            out.extend(int(i) for i in chunk)
            self.position += len(chunk)
        return out

    @property
    def consumed(self) -> int:
        """Total prompts handed out since the start (over all epochs)."""
        return self.epoch * self.num_prompts + self.position

    def state_dict(self) -> dict:
        """Everything needed to continue exactly here (plain ints and lists; JSON-safe)."""
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "deferred": list(self._deferred),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from :meth:`state_dict`; refuses one from a different dataset/seed."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"PromptCursor state has {key}={state.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)!r}: the dataset or data seed changed since the checkpoint"
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_prompts:
            raise ValueError(f"PromptCursor state position {position} is outside 0..{self.num_prompts}")
        self.epoch = int(state["epoch"])
        self.position = position
        self._deferred = [int(i) for i in state.get("deferred", [])]
        self._order = self._epoch_order()

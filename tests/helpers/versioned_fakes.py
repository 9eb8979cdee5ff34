"""A fake engine and a fake policy whose logprobs depend on the weight version, for loop tests of
schedulers that train off-policy tokens (tests/unit/test_peers_loop.py).

The policy at version v gives every token the logprob ``lp(v) = -0.5 - 0.1 v``, and the engine
samples with the same function of the version it holds. So an on-policy token's trainer and
engine logprobs agree exactly, and a token k versions old carries the truncated importance weight
``min(exp(lp(v) - lp(v - k)), cap) = exp(-0.1 k)``. The policy trains through the real loss
(``algorithms.losses.compute_policy_loss``) and reports parity over on-policy tokens the way the
Megatron worker does, so the loop's metrics come out of the same code paths.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.losses import compute_policy_loss
from megatron_rl.config.schema import RunConfig
from megatron_rl.rollout.engine import Completion, GenerationRequest
from megatron_rl.training.step_metrics import parity_metrics
from tests.helpers.fake_engine import FakeEngine


def logprob_at(version: int) -> float:
    """Every token's logprob under the weights of ``version`` (engine and trainer alike)."""
    return -0.5 - 0.1 * version


class AnsweringEngine(FakeEngine):
    """Responses spell '#### 7' (even seeds: right) or '#### 8' (odd: wrong), padded with spaces
    to the length ``length_fn`` picks, then EOS; logprobs are ``logprob_at(engine version)``.
    ``reloads_in_flight`` counts weight reloads refused because requests were running."""

    def __init__(self, tokenizer, length_fn, capacity: int = 256, tick_s: float = 0.0) -> None:
        super().__init__(length_fn=length_fn, capacity=capacity, tick_s=tick_s)
        self.tok = tokenizer

    def _emit(self, req: GenerationRequest, n: int, reason: str, t0: float) -> None:
        text = "#### 7" if req.seed % 2 == 0 else "#### 8"
        full = self.tok.encode(" " * 400 + text, add_special_tokens=False) + [self.tok.eos_token_id]
        ids = full[-n:] if reason != "abort" else full[:n]
        self.queue.put_nowait(Completion(req.request_id, ids, [logprob_at(self.version)] * len(ids), reason,
                                         self.version, t0, time.monotonic()))


class VersionedPolicy:
    """The Policy contract without Megatron, for ``rollout.weight_sync_format=hf``: its version is
    the number of optimizer steps; every train step runs the real loss on ``logprob_at(version)``
    and records what it was given."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.steps = 0
        self.trained: list[list] = []
        """Per train step: the samples as given (staleness, old logprobs, engine logprobs...)."""
        self.scored = 0

    async def compute_logprobs(self, samples, which="policy"):
        self.scored += 1
        return [[logprob_at(self.steps)] * len(s.response_ids) for s in samples]

    async def train_step(self, samples):
        self.trained.append(list(samples))
        recompute = self.cfg.algorithm.recomputes_old_logprobs()
        if recompute != all(len(s.old_logprobs) == len(s.response_ids) for s in samples):
            raise AssertionError(f"old logprobs given: {not recompute}, expected {recompute}")
        metrics: dict[str, float] = {}
        tokens = sum(len(s.response_ids) for s in samples)
        for s in samples:
            n = len(s.response_ids)
            logp = torch.full((n,), logprob_at(self.steps), requires_grad=True)
            old = torch.tensor(s.old_logprobs) if recompute else logp.detach()
            engine = torch.tensor(s.engine_logprobs)
            staleness = torch.tensor(s.staleness, dtype=torch.float32) if s.staleness else None
            _, values = compute_policy_loss(logp, old, torch.full((n,), s.advantage), torch.ones(n),
                                            cfg=self.cfg.algorithm, engine_logprobs=engine,
                                            **({} if staleness is None else {"staleness": staleness}),
                                            num_tokens_total=tokens, num_seqs_total=len(samples),
                                            seq_ids=torch.zeros(n, dtype=torch.long))
            if not recompute:  # the training forward scores the batch: parity over on-policy tokens
                mask = torch.ones(n) if staleness is None else (staleness == 0).float()
                values.update(parity_metrics(logp, engine, mask))
            for key, value in values.items():
                metrics[key] = max(metrics.get(key, value), value) if key.endswith("_max") else metrics.get(key, 0.0) + value
        self.steps += 1
        return metrics

    async def free_grad_buffers(self):
        return {}

    async def offload_for_rollout(self):
        return {}

    async def reload_for_training(self):
        return {}

    async def set_num_threads(self, n):
        pass

    async def write_hf_weights(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)

    async def save_checkpoint(self, directory):
        Path(directory, "policy.json").write_text(json.dumps({"steps": self.steps}))

    async def load_checkpoint(self, directory):
        self.steps = json.loads(Path(directory, "policy.json").read_text())["steps"]
        return {}

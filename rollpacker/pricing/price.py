"""Pricing a run: per step, the rollout (its traced iterations), training (its trained samples)
and step time under a cost model, the measured times beside them, and the packing limit.

Rollout of a step: ``round_fixed_s + max over engines of the summed iteration prices`` of the
engine lines drained after that step's rollout. Training: the model's price of the step's
batch line. Step: rollout + training + the model's other per-step part (0 on GPU models).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from rollpacker.pricing.cpu_model import TRAIN_KEYS, CpuModel, round_engine_s
from rollpacker.pricing.gpu_model import GpuModel, gpu_model
from rollpacker.pricing.packing import PackingLimit, measured_speculation, packing_limit
from rollpacker.pricing.trace import RunTrace, read_trace


@dataclass(frozen=True)
class StepPrice:
    step: int
    round: str
    engines: int
    iterations: int
    """Iterations of the busiest engine in this step's drain."""
    rollout_s: float
    train_s: float
    step_s: float
    measured_rollout_s: float | None
    measured_train_s: float | None
    measured_step_s: float | None
    packing: PackingLimit | None


@dataclass
class RunPrice:
    run_dir: str
    model: str
    steps: list[StepPrice] = field(default_factory=list)
    run_packing: PackingLimit | None = None
    """The whole run's trained responses packed as if steps did not separate them (slots full
    across step boundaries, each response still one iteration per token): the limit of packing
    decode steps full, which a step-synchronous schedule can only approach. Per step, a batch
    smaller than the slots has its longest response for a limit, so a synchronous baseline sits
    near 1.0 there however empty its slots run."""

    def total(self, key: str) -> float:
        return sum(getattr(s, key) or 0.0 for s in self.steps)

    @property
    def packing_iteration_fraction(self) -> float:
        """Sum of the limit's iterations over the sum of the actual ones (steps with a batch)."""
        steps = [s.packing for s in self.steps if s.packing is not None]
        actual = sum(p.actual_iterations for p in steps)
        return sum(p.iterations for p in steps) / actual if actual else float("nan")

    @property
    def packing_time_fraction(self) -> float:
        steps = [s.packing for s in self.steps if s.packing is not None]
        actual = sum(p.actual_time_s for p in steps)
        return sum(p.time_s for p in steps) / actual if actual > 0 else float("nan")

    def summary(self) -> dict:
        """Run totals; ``warm_*``: rollout over the steps after the first (engine warm-up)."""
        fr = [s.packing.time_fraction for s in self.steps if s.packing is not None]
        return {"steps": len(self.steps),
                **{k: self.total(k) for k in ("rollout_s", "train_s", "step_s", "measured_rollout_s",
                                               "measured_train_s", "measured_step_s")},
                "warm_rollout_s": sum(s.rollout_s for s in self.steps[1:]),
                "warm_measured_rollout_s": sum(s.measured_rollout_s or 0.0 for s in self.steps[1:]),
                "packing_iteration_fraction": self.packing_iteration_fraction,
                "packing_time_fraction": self.packing_time_fraction,
                "packing_time_fraction_median_step": median(fr) if fr else float("nan"),
                "run_packing_iteration_fraction": self.run_packing.iteration_fraction if self.run_packing else float("nan"),
                "run_packing_time_fraction": self.run_packing.time_fraction if self.run_packing else float("nan")}

    def to_dict(self) -> dict:
        steps = []
        for s in self.steps:
            d = asdict(s)
            if s.packing is not None:
                d["packing"].update(iteration_fraction=s.packing.iteration_fraction, time_fraction=s.packing.time_fraction)
            steps.append(d)
        return {"run_dir": self.run_dir, "model": self.model, "summary": self.summary(), "steps": steps}


def _measured(m: dict | None, keys: tuple[str, ...]) -> float | None:
    if m is None or not any(k in m for k in keys):
        return None
    return sum(float(m.get(k, 0.0)) for k in keys)


def price_trace(run: RunTrace, model: CpuModel | GpuModel) -> RunPrice:
    """Price an already read run under ``model``."""
    out = RunPrice(str(run.run_dir), model.describe())
    for step in run.steps:
        blocks = run.blocks_of(step)
        rollout = model.round_fixed_s() + round_engine_s(model, blocks) if blocks else 0.0
        train = model.train_s(run, step)
        per_engine: dict[int, int] = {}
        for b in blocks:
            per_engine[b.engine] = per_engine.get(b.engine, 0) + b.iterations
        iterations = max(per_engine.values(), default=0)
        batch, packing = run.batches.get(step), None
        if batch is not None and blocks:
            tp, seqs = blocks[0].tp, max(b.max_num_seqs for b in blocks)
            packing = packing_limit(batch.prompt_tokens, batch.response_tokens, len(per_engine), seqs,
                                    lambda d, c, p: model.cost(tp, seqs, d, c, p), model.round_fixed_s(),
                                    measured_speculation(blocks), iterations, rollout)
        m = run.metrics.get(step)
        out.steps.append(StepPrice(step, blocks[0].round if blocks else (batch.round if batch else ""), len(per_engine),
                                   iterations, rollout, train, rollout + train + model.other_s(),
                                   _measured(m, ("time/rollout",)), _measured(m, TRAIN_KEYS), _measured(m, ("time/step",)),
                                   packing))
    out.run_packing = _run_packing(run, model, out)
    return out


def _run_packing(run: RunTrace, model: CpuModel | GpuModel, price: RunPrice) -> PackingLimit | None:
    """:attr:`RunPrice.run_packing`: every step's trained samples in one packing, against the
    run's actual iterations and priced rollout (the steps with a batch and a trace)."""
    steps = [s for s in price.steps if s.packing is not None]
    if not steps:
        return None
    blocks = [b for s in steps for b in run.blocks_of(s.step)]
    prompts = [p for s in steps for p in run.batches[s.step].prompt_tokens]
    responses = [r for s in steps for r in run.batches[s.step].response_tokens]
    tp, seqs = blocks[0].tp, max(b.max_num_seqs for b in blocks)
    return packing_limit(prompts, responses, max(s.engines for s in steps), seqs,
                         lambda d, c, p: model.cost(tp, seqs, d, c, p), len(steps) * model.round_fixed_s(),
                         measured_speculation(blocks), sum(s.iterations for s in steps), sum(s.rollout_s for s in steps))


def price_run(run_dir: str | Path, model: CpuModel | GpuModel | str, as_model: str | None = None,
              engine_constants: str | Path | None = None) -> RunPrice:
    """Price the run at ``run_dir``. ``model``: a fitted CpuModel, a GpuModel, or a GPU name
    ('h800' | 'h100' | 'h200') whose model is built from this run's config (``as_model``: price
    the run's token schedule as a built-in Qwen2.5 shape; ``engine_constants``: measured constants)."""
    run = read_trace(run_dir)
    if isinstance(model, str):
        model = gpu_model(run, model, as_model, engine_constants)
    return price_trace(run, model)

"""GPU cost models (H800 / H100 / H200) from stated physical quantities.

Rollout: each traced iteration costs what the simulator's engine model charges on that GPU,
``step_s + per_seq_s * decode_tokens + per_ctx_token_s * context_tokens + prefill_token_s *
prefill_tokens``, with the constants of ``EngineModel.for_gpu`` (datasheet HBM bandwidth and
bf16 FLOP/s of ``megatron_rl.planning.memory.GPUS``, the efficiencies ``GpuEfficiency`` states)
for the model's shape at the iteration's engine TP, or the GPU check's measured constants
(``EngineModel.from_json``, regrouped to the engine's TP). ``step_s`` holds the per-iteration
overhead (scheduler, sampler, launches); there is no per-round part. Training:
``TrainModel.from_recipe`` on the trained samples' lengths (FLOPs over the recipe's trainer
GPUs at an assumed MFU) plus its weight sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config.loading import load_config
from megatron_rl.config.schema import RunConfig
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.architectures import BUILTIN_SHAPES, ModelShape, resolve_shape
from megatron_rl.planning.memory import GPUS, GpuSpec
from rollpacker.pricing.trace import EngineBlock, RunTrace, TraceError
from rollpacker.simulator.costs import TrainModel
from rollpacker.simulator.engine_model import EngineModel, GpuEfficiency

PRICED_GPUS = ("h800", "h100", "h200")
TRAIN_MFU = 0.4
"""Assumed model-FLOPs utilisation of training (the simulator's default)."""


def run_config(run: RunTrace) -> RunConfig:
    """The run's config.json as a RunConfig (errors name the key)."""
    try:
        return load_config(run.run_dir / "config.json")
    except ConfigError as exc:
        raise TraceError(f"{run.run_dir / 'config.json'}: {exc}") from None


def model_shape(cfg: RunConfig, as_model: str | None) -> ModelShape:
    """``as_model``'s built-in shape, or the run's own model (model.hf_path's config.json)."""
    if as_model:
        if as_model not in BUILTIN_SHAPES:
            raise TraceError(f"--as-model: {as_model!r} is none of {sorted(BUILTIN_SHAPES)}")
        return BUILTIN_SHAPES[as_model]
    try:
        return resolve_shape(cfg.model.hf_path)
    except ConfigError as exc:
        raise TraceError(f"{exc} (or price as a built-in shape with --as-model)") from None


@dataclass
class GpuModel:
    """Prices one run's token schedule on ``gpu`` as ``shape``."""

    gpu: GpuSpec
    shape: ModelShape
    cfg: RunConfig
    constants: EngineModel | None = None
    """The GPU check's measured constants; None: EngineModel.for_gpu from the datasheet."""
    mfu: float = TRAIN_MFU
    efficiency: GpuEfficiency = GpuEfficiency()
    _engines: dict[tuple[int, int], EngineModel] = field(default_factory=dict)
    _train: TrainModel | None = None

    @property
    def name(self) -> str:
        return self.gpu.name

    def engine(self, tp: int, max_num_seqs: int) -> EngineModel:
        key = (tp, max_num_seqs)
        if key not in self._engines:
            if self.constants is not None:
                self._engines[key] = self.constants.with_tp(tp)
            else:
                self._engines[key] = EngineModel.for_gpu(self.shape, self.gpu, tp, self.cfg.rollout.gpu_memory_utilization,
                                                         max_num_seqs, self.efficiency)
        return self._engines[key]

    def cost(self, tp: int, max_num_seqs: int, decode: float, context: float, prefill: float) -> float:
        e = self.engine(tp, max_num_seqs)
        return e.step_s + e.per_seq_s * decode + e.per_ctx_token_s * context + e.prefill_token_s * prefill

    def iteration_s(self, block: EngineBlock) -> list[float]:
        r = block.rows
        return [self.cost(block.tp, block.max_num_seqs, d, c, p)
                for d, c, p in zip(r["decode_tokens"], r["context_tokens"], r["prefill_tokens"])]

    def round_fixed_s(self) -> float:
        return 0.0

    @property
    def train_model(self) -> TrainModel:
        if self._train is None:
            self._train = TrainModel.from_recipe(self.cfg, self.shape, self.gpu, mfu=self.mfu)
        return self._train

    def train_s(self, run: RunTrace, step: int) -> float:
        batch = run.batches.get(step)
        if batch is None:
            return 0.0
        seqs = [p + r for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
        return self.train_model.time(seqs) + self.train_model.sync_s

    def other_s(self) -> float:
        return 0.0

    def describe(self) -> str:
        e = self.constants
        src = "measured constants (GPU check)" if e is not None else (
            f"datasheet {self.gpu.hbm_gb_per_s:.0f} GB/s HBM, {self.gpu.bf16_tflops:.0f} bf16 TFLOP/s; efficiencies: "
            f"HBM {self.efficiency.hbm}, decode matmul {self.efficiency.decode_mfu}, prefill {self.efficiency.prefill_mfu}, "
            f"{self.efficiency.step_overhead_s * 1e3:g} ms per iteration")
        t = self.train_model
        return (f"{self.gpu.name} pricing {self.shape.name} ({self.shape.total_params / 1e9:.2f} B params): rollout from {src}; "
                f"training on {t.gpus} GPU(s) (the run's TP x PP x CP x DP) at MFU {self.mfu}, weight sync {t.sync_s:.2f} s/step")


def gpu_model(run: RunTrace, gpu: str, as_model: str | None = None, constants: str | Path | None = None) -> GpuModel:
    """The ``gpu`` (h800 | h100 | h200) model of ``run``."""
    if gpu not in PRICED_GPUS:
        raise TraceError(f"--gpu: {gpu!r} is none of cpu, {', '.join(PRICED_GPUS)}")
    cfg = run_config(run)
    measured = None
    if constants is not None:
        try:
            measured = EngineModel.from_json(constants)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
    return GpuModel(GPUS[gpu], model_shape(cfg, as_model), cfg, measured)

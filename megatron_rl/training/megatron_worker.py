"""MegatronWorker: one trainer rank holding the policy (and optional frozen reference) model.

A plain class; the driver wraps it as a Ray actor and calls every method on all ranks (SPMD),
always with the same arguments. Each rank takes its data-parallel share of the samples itself.

Gradient contract of :meth:`train_step`: the loss callable returns a microbatch loss already
divided by the FULL mini-batch's token (or sequence) count, so the sum of microbatch losses over
all microbatches and DP ranks is the mini-batch loss. Megatron is configured not to rescale
anything: ``calculate_per_token_loss=True`` (no division by the number of microbatches, DDP
sums rather than averages over DP) and a finalize hook that skips the per-token division. The
gradient is therefore that of the full mini-batch loss whatever the microbatching, PP or DP.

Streamed accumulation (:meth:`accumulate_gradients` per chunk, then one
:meth:`apply_accumulated_gradients`) computes the same gradient when the batch arrives in pieces
whose totals are unknown until the end: each chunk's losses are raw sums (normalisers 1), the
grad finalisation (DP all-reduce, tied-embedding sync) runs once at the end, and the summed
buffers are scaled by 1/N then. Both finalisation and the loss are linear, so the result equals
the ordinary step up to fp rounding.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_rl.config.schema import RunConfig
from megatron_rl.distributed.cpu_shim import with_cpu_device_mode
from megatron_rl.distributed.process_groups import (
    ParallelLayout,
    destroy_process_groups,
    init_distributed,
    init_model_parallel,
)
from megatron_rl.model.qwen2 import build_gpt_model, build_transformer_config, read_qwen2_arch
from megatron_rl.runtime.fault_injection import fault_point_in_backward
from megatron_rl.sample import Sample
from megatron_rl.training.dist_checkpoint import load_model_weights, load_trainer_state, save_trainer_state
from megatron_rl.training.legacy_checkpoint import is_legacy, load_legacy
from megatron_rl.training.logprobs import run_microbatches
from megatron_rl.training.memory_offload import TrainerOffload, with_training_state
from megatron_rl.training.packing import (
    Microbatch,
    balance_across_ranks,
    build_microbatch,
    pack_microbatches,
    response_values,
    sequence_multiple,
)
from megatron_rl.training.step_metrics import LOSS_METRICS, TOKEN_METRICS, combine, combine_over_ranks, parity_metrics
from megatron_rl.training.weight_export import WeightExport
from megatron_rl.training.weight_push import WeightPush
from megatron_rl.training.weights_io import load_hf_into_model

# loss_fn(logprobs, old_logprobs, advantages, mask, *, ref_logprobs, engine_logprobs, seq_ids,
#         num_tokens_total, num_seqs_total[, staleness]) -> (loss, metrics); the signature of
# megatron_rl.algorithms.losses.compute_policy_loss with ``cfg`` bound (functools.partial).
LossFn = Callable[..., tuple[torch.Tensor, dict]]


def _finalize_grads_without_token_scaling(model: list, num_tokens: Any, *args: Any, **kwargs: Any) -> None:
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) without dividing by the
    token count: our losses are already normalised by the full batch."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, *args, **kwargs)


@dataclass
class _Accumulation:
    """Gradients accumulated since the last optimizer step (see accumulate_gradients)."""

    metrics: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    time_s: float = 0.0
    torch_threads: int = 0  # the most torch threads a chunk was computed with
    failed: str = ""  # a chunk died mid-schedule: the buffers hold part of it


def _optional_field(samples: list[Sample], name: str) -> list[list[float]] | None:
    """Per-sample list field, None when no sample has it; an error when only some do."""
    present = [bool(getattr(s, name)) or not s.response_ids for s in samples]
    if not any(bool(getattr(s, name)) for s in samples):
        return None
    if not all(present):
        bad = present.index(False)
        raise ValueError(f"sample {bad} ({samples[bad].prompt.prompt_id}) has no {name} while others do")
    return [list(getattr(s, name)) for s in samples]


class MegatronWorker(WeightExport, WeightPush):
    """One Megatron trainer rank: load HF weights, logprobs, train steps, export, checkpoints."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        torch.set_num_threads(int(os.environ.get("MEGATRON_RL_NUM_THREADS", "1")))
        self.cfg = cfg
        self.rank = rank
        par = cfg.parallel
        self.layout = ParallelLayout(
            par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
        )
        init_distributed(rank, world_size, master_addr, master_port)
        init_model_parallel(self.layout, cfg.trainer.seed)
        from megatron.core import parallel_state as ps

        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.arch = None
        self.steps_done = 0
        self._accumulated: _Accumulation | None = None  # None: nothing since the last step
        self._offload = TrainerOffload()  # what offload_for_rollout moved away
        self.rollout_shard_plans: dict = {}  # (arch, rollout TP, dtype) -> RolloutShardPlan

    # ----------------------------------------------------------------- set-up
    def _build(self, trainable: bool) -> torch.nn.Module:
        from megatron.core import parallel_state as ps

        tcfg = build_transformer_config(
            self.arch, self.cfg.model.dtype, self.layout.tensor_model_parallel_size,
            self.layout.pipeline_model_parallel_size, self.cfg.parallel.sequence_parallel,
            self.cfg.parallel.recompute_granularity,
        )
        model = build_gpt_model(
            self.arch, tcfg, self.layout.tensor_model_parallel_size,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            transformer_impl=self.cfg.model.transformer_impl, local_attention=self.cfg.model.local_attention,
        )
        if torch.cuda.is_available():
            # As Megatron's own get_model does: its parallel linears are created on the current
            # device, but the local spec's torch norms (and any plain torch module) on the CPU.
            model.cuda(torch.cuda.current_device())
        if tcfg.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(tcfg, model)
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
            average_in_collective=False,  # required by calculate_per_token_loss: DP grads are summed
        )
        model = DistributedDataParallel(tcfg, ddp_cfg, model)
        tcfg.no_sync_func = model.no_sync
        tcfg.finalize_model_grads_func = _finalize_grads_without_token_scaling
        return model

    def _build_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt = self.cfg.optimizer
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=opt.lr,
            min_lr=opt.lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2,
            clip_grad=opt.grad_clip,
            bf16=self.cfg.model.dtype == "bfloat16",
            params_dtype=torch.bfloat16 if self.cfg.model.dtype == "bfloat16" else torch.float32,
            use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
        )
        return get_megatron_optimizer(ocfg, [self.model])

    @with_cpu_device_mode
    def load_hf(self, hf_path: str) -> None:
        """Build the policy (+ optimizer) from an HF Qwen2 checkpoint; also the frozen reference
        model when ``model.use_reference_model`` or ``algorithm.kl_coef > 0``."""
        self.arch = read_qwen2_arch(hf_path)
        self.hf_path = hf_path  # its config/tokenizer files go along with exported weights
        shard_args = (self.arch, self.tp_rank, self.layout.tensor_model_parallel_size,
                      self.pp_rank, self.layout.pipeline_model_parallel_size)
        self.model = self._build(trainable=True)
        self._load_weights(self.model, hf_path, shard_args)
        self.optimizer = self._build_optimizer()
        # The optimizer may keep fp32 master copies: refresh them from the loaded weights.
        self.optimizer.reload_model_params()
        self._accumulated = None  # fresh grad buffers: nothing of an earlier model is pending
        self._offload = TrainerOffload()  # a new model: nothing of it is offloaded
        if self.cfg.model.use_reference_model or self.cfg.algorithm.kl_coef > 0:
            self.reference = self._build(trainable=False)
            self._load_weights(self.reference, hf_path, shard_args)

    def _load_weights(self, model: torch.nn.Module, hf_path: str, shard_args: tuple) -> None:
        """This rank's shard from ``model.megatron_checkpoint`` when set (a dist checkpoint at any
        layout, or a LEGACY per-(TP, PP) conversion at its own), else from ``hf_path``."""
        directory = self.cfg.model.megatron_checkpoint
        if not directory:
            load_hf_into_model(model, hf_path, *shard_args)
            return
        from megatron_rl.resharding import checkpoint_format as fmt

        label = f"model.megatron_checkpoint {directory}"
        if not fmt.is_legacy_converted(directory):
            load_model_weights(directory, model, label)
            return
        tp, pp = self.layout.tensor_model_parallel_size, self.layout.pipeline_model_parallel_size
        shard = fmt.read_converted_shard(directory, self.tp_rank, self.pp_rank, tp, pp)
        fmt.load_shard_into_model(model, shard, f"{label} (tp {self.tp_rank}, pp {self.pp_rank})")

    # ----------------------------------------------------------------- batching
    def _my_microbatches(self, samples: list[Sample], fields: bool) -> list[Microbatch]:
        """This DP rank's share of ``samples`` as padded microbatches (indices refer to ``samples``)."""
        lengths = [s.num_tokens for s in samples]
        if len(lengths) >= self.dp_size:
            mine = balance_across_ranks(lengths, self.dp_size)[self.dp_rank]
        else:  # a small stream chunk (or logprob call): some DP ranks get nothing and skip compute
            mine = [self.dp_rank] if self.dp_rank < len(lengths) else []
        # Under sequence parallelism every width must divide by TP (see packing.sequence_multiple).
        multiple = sequence_multiple(self.layout.tensor_model_parallel_size, self.cfg.parallel.sequence_parallel)
        groups = pack_microbatches([lengths[i] for i in mine], self.cfg.optimizer.micro_batch_tokens, multiple)
        token_fields: dict[str, list[list[float]] | None] = {}
        seq_fields: dict[str, list[float]] = {}
        if fields:
            recompute = self.cfg.algorithm.recomputes_old_logprobs()  # else the training forward's own
            if not recompute and any(s.old_logprobs for s in samples):
                raise ValueError("samples carry old_logprobs but algorithm.recompute_old_logprobs resolves to false "
                                 "(one optimizer step: the training forward's own logprobs are the old ones); set "
                                 "algorithm.recompute_old_logprobs=true to train against given old logprobs")
            for i, s in enumerate(samples):
                if recompute and s.response_ids and len(s.old_logprobs) != len(s.response_ids):
                    raise ValueError(
                        f"sample {i} ({s.prompt.prompt_id}, response {s.response_index}): old_logprobs has "
                        f"{len(s.old_logprobs)} values for {len(s.response_ids)} response tokens"
                    )
            token_fields = {"old_logprobs": [list(s.old_logprobs) for s in samples] if recompute else None,
                            "ref_logprobs": _optional_field(samples, "ref_logprobs"),
                            "engine_logprobs": _optional_field(samples, "engine_logprobs"),
                            # Only when some token is off-policy (the loop sets it then): which
                            # tokens the parity check may hold against the engine.
                            "staleness": _optional_field(samples, "staleness")}
            seq_fields = {"advantages": [s.advantage for s in samples]}
        out = []
        for group in groups:
            idx = [mine[j] for j in group]
            out.append(build_microbatch(
                [(samples[i].prompt.token_ids, samples[i].response_ids) for i in idx], idx,
                token_fields={k: [v[i] for i in idx] for k, v in token_fields.items() if v is not None},
                seq_fields={k: [v[i] for i in idx] for k, v in seq_fields.items()},
                width_multiple=multiple,
            ))
        return out

    def _is_loss_rank(self) -> bool:
        # One rank per DP replica reports results: the last PP stage's TP rank 0.
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and self.tp_rank == 0

    # ----------------------------------------------------------------- logprobs
    @with_training_state
    def compute_logprobs(self, samples: list[Sample], which: str = "policy") -> list[list[float]]:
        """Per-token logprobs of each sample's response under the policy or the reference model.

        Forward-only through Megatron's schedule (PP microbatches, vocab-parallel CE). Every rank
        returns the full list, in the input order.
        """
        model = {"policy": self.model, "reference": self.reference}.get(which)
        if model is None:
            raise ValueError(f"compute_logprobs: no {which!r} model (call load_hf; reference needs "
                             "model.use_reference_model or algorithm.kl_coef > 0)")
        model.eval()
        mbs = self._my_microbatches(samples, fields=False)

        def collect(batch: Microbatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return logprobs.sum() * 0.0, dict(zip(batch.seq_ids.tolist(), response_values(logprobs, batch)))

        payloads = run_microbatches(model, mbs, collect, self.arch.vocab_size, forward_only=True)
        mine = {k: v for p in payloads for k, v in p.items()} if self._is_loss_rank() else {}
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        merged = {k: v for part in gathered for k, v in part.items()}
        return [merged[i] for i in range(len(samples))]

    # ----------------------------------------------------------------- training
    @with_training_state
    def train_step(self, samples: list[Sample], loss_fn: LossFn) -> dict[str, float]:
        """``algorithm.ppo_mini_batches`` optimizer steps over ``samples`` (split in order).

        ``loss_fn`` is called per microbatch with [B, L] tensors (see ``LossFn``); its loss must
        be normalised by the mini-batch totals it is given. Returns mean loss-metrics over
        mini-batches (each summed over microbatches and DP ranks), grad norm, lr, tokens, time and
        the torch threads this rank computed with (``torch_threads``: on CPU, ``MEGATRON_RL_NUM_THREADS``
        unless the trainer was lent more, see ``Colocation.lend_engines``).
        """
        start = time.perf_counter()
        if self._accumulated is not None:
            raise RuntimeError("train_step: gradients from accumulate_gradients are pending; call "
                               "apply_accumulated_gradients or discard_accumulated_gradients first")
        n_mini = self.cfg.algorithm.ppo_mini_batches
        if n_mini != 1 and not self.cfg.algorithm.recomputes_old_logprobs():
            raise ValueError(f"algorithm.recompute_old_logprobs=false needs algorithm.ppo_mini_batches == 1 "
                             f"(after the first optimizer step the weights are no longer the old policy), got {n_mini}")
        if len(samples) < n_mini * self.dp_size:
            raise ValueError(f"{len(samples)} samples cannot fill algorithm.ppo_mini_batches={n_mini} "
                             f"x data_parallel_size={self.dp_size}")
        bounds = [round(k * len(samples) / n_mini) for k in range(n_mini + 1)]
        totals: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            mini = samples[lo:hi]
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            # The schedule ends with the finalize hook (DP all-reduce, tied-embedding sync).
            metrics = self._forward_backward(self._my_microbatches(mini, fields=True), loss_fn,
                                             sum(len(s.response_ids) for s in mini), len(mini))
            grad_norms.append(self._optimizer_step())
            for key, value in metrics.items():
                combine(totals, key, value, 1.0 / n_mini)
        self.steps_done += 1
        totals.update({
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.cfg.optimizer.lr,
            "tokens": float(sum(len(s.response_ids) for s in samples)),
            "optimizer_steps": float(n_mini),
            "time_s": time.perf_counter() - start,
            "torch_threads": float(torch.get_num_threads()),
        })
        return totals

    @with_training_state
    def accumulate_gradients(self, samples: list[Sample], loss_fn: LossFn) -> dict[str, float]:
        """Forward+backward over this DP rank's share of ``samples``, adding to the gradient of
        the step :meth:`apply_accumulated_gradients` will take; no optimizer step.

        The first call after an optimizer step zeroes the gradients. ``loss_fn`` gets
        ``num_tokens_total=num_seqs_total=1`` (the batch totals are not known yet), so every
        loss and metric is a raw sum; the apply call normalises. Megatron's grad finalisation
        is skipped here: it must run once over the complete sums (re-reducing already reduced
        buffers per chunk would multiply them). A DP rank without samples skips the compute.
        Needs ``algorithm.ppo_mini_batches == 1``. Returns this chunk's raw metrics, summed
        over microbatches and ranks. Collective: every rank calls it with the same samples.
        """
        from megatron.core.utils import get_model_config

        if self.cfg.algorithm.ppo_mini_batches != 1:
            raise ValueError(f"accumulate_gradients needs algorithm.ppo_mini_batches == 1 (one optimizer step "
                             f"per batch), got {self.cfg.algorithm.ppo_mini_batches}")
        if self._accumulated is not None and self._accumulated.failed:
            raise RuntimeError(f"accumulate_gradients: an earlier chunk failed ({self._accumulated.failed}); "
                               "call discard_accumulated_gradients")
        start = time.perf_counter()
        mbs = self._my_microbatches(samples, fields=True)  # bad samples raise here, before any compute
        if self._accumulated is None:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._accumulated = _Accumulation()
        acc = self._accumulated
        self.model.train()
        config = get_model_config(self.model)
        finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
        try:
            raw = self._forward_backward(mbs, loss_fn, 1, 1)
        except BaseException as exc:  # part of the chunk may be in the buffers: poison the step
            acc.failed = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            config.finalize_model_grads_func = finalize
        for key, value in raw.items():
            combine(acc.metrics, key, value)
        acc.samples += len(samples)
        acc.tokens += sum(len(s.response_ids) for s in samples)
        acc.time_s += time.perf_counter() - start
        acc.torch_threads = max(acc.torch_threads, torch.get_num_threads())
        return raw

    @with_training_state
    def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict[str, float]:
        """One optimizer step on everything :meth:`accumulate_gradients` added since the last.

        Runs the grad finalisation once, scales the gradient by 1/N (N = ``num_tokens_total``
        for ``algorithm.loss_agg`` token_mean, else ``num_seqs_total``: the full batch's
        response tokens and sequences) and steps (with clipping). The raw metrics are kept in
        the worker; returns them normalised as :meth:`train_step` reports them (loss, pg_loss,
        kl_loss / N; token metrics / num_tokens_total; counts unchanged) plus grad_norm, lr,
        tokens, optimizer_steps=1, time_s (all accumulate calls plus this one) and torch_threads (the
        most of any of these calls). Collective.
        """
        from megatron.core.distributed import finalize_model_grads

        acc = self._accumulated
        if acc is None or acc.samples == 0:
            raise RuntimeError("apply_accumulated_gradients: nothing accumulated since the last optimizer step")
        if acc.failed:
            raise RuntimeError(f"apply_accumulated_gradients: a chunk failed ({acc.failed}); "
                               "call discard_accumulated_gradients")
        if num_tokens_total <= 0 or num_seqs_total <= 0:
            raise ValueError(f"num_tokens_total={num_tokens_total} and num_seqs_total={num_seqs_total} must be > 0")
        start = time.perf_counter()
        norm = num_tokens_total if self.cfg.algorithm.loss_agg == "token_mean" else num_seqs_total
        finalize_model_grads([self.model], None)
        self.model.scale_gradients(1.0 / norm)
        grad_norm = self._optimizer_step()
        self._accumulated = None
        self.steps_done += 1
        out = {key: value / norm if key in LOSS_METRICS else value / num_tokens_total if key in TOKEN_METRICS
               else value for key, value in acc.metrics.items()}
        out.update({"grad_norm": grad_norm, "lr": self.cfg.optimizer.lr, "tokens": float(acc.tokens),
                    "optimizer_steps": 1.0, "time_s": acc.time_s + time.perf_counter() - start,
                    "torch_threads": float(max(acc.torch_threads, torch.get_num_threads()))})
        return out

    def discard_accumulated_gradients(self) -> None:
        """Forget what :meth:`accumulate_gradients` added (the next call starts from zero)."""
        self._accumulated = None

    @with_cpu_device_mode
    def free_grad_buffers(self) -> dict[str, int]:
        """:meth:`offload_for_rollout`'s first part alone (before a push reading the weights): the grad buffers."""
        if self._accumulated is not None:
            raise RuntimeError("free_grad_buffers: gradients from accumulate_gradients are pending; discard them first")
        return {"grad_buffers_freed": self._offload.free_grad_buffers(self.model)}

    @with_cpu_device_mode
    def offload_for_rollout(self) -> dict[str, int]:
        """``trainer.offload_during_rollout``, after the weight sync: free the grad buffers (the last
        step's gradients are dropped) and, on GPUs, move optimizer state and weights to the host
        (``memory_offload``). Returns this rank's bytes per kind. Training-state calls reload
        themselves (with a warning) if :meth:`reload_for_training` was skipped. Not collective."""
        if self._accumulated is not None:
            raise RuntimeError("offload_for_rollout: gradients from accumulate_gradients are pending; "
                               "apply or discard them first")
        return self._offload.offload(self.model, self.optimizer, self.reference)

    @with_cpu_device_mode
    def reload_for_training(self) -> dict[str, int]:
        """Undo :meth:`offload_for_rollout` (no-op when not offloaded); call before logprobs."""
        return self._offload.reload()

    def _forward_backward(self, mbs: list[Microbatch], loss_fn: LossFn, num_tokens_total: int,
                          num_seqs_total: int) -> dict[str, float]:
        """Run this DP rank's microbatches forward and backward into the grad buffers with the
        given loss normalisers; return the loss metrics summed over microbatches and ranks.
        Collective."""

        def loss_callback(batch: Microbatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, Any]:
            # Fault-injection tests kill a rank here, mid-backward (inert unless armed).
            fault_point_in_backward(logprobs, "train.backward", step=self.steps_done, rank=self.rank)
            old, engine = batch.fields.get("old_logprobs"), batch.fields.get("engine_logprobs")
            scored_here = old is None  # algorithm.recompute_old_logprobs=false: these weights generated the batch
            if scored_here:
                old = logprobs.detach()
            staleness = batch.fields.get("staleness")
            # Passed only when set: a loss that knows nothing of off-policy data keeps working.
            stale_kw = {} if staleness is None else {"staleness": staleness}
            loss, metrics = loss_fn(
                logprobs, old, batch.fields["advantages"], batch.loss_mask,
                ref_logprobs=batch.fields.get("ref_logprobs"), engine_logprobs=engine,
                seq_ids=batch.segment_ids, num_tokens_total=num_tokens_total, num_seqs_total=num_seqs_total,
                **stale_kw,
            )
            values = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in metrics.items()}
            values.setdefault("loss", float(loss.detach()))
            if scored_here and engine is not None:
                on_policy = batch.loss_mask if staleness is None else batch.loss_mask * (staleness == 0)
                values.update(parity_metrics(logprobs, engine, on_policy))
            return loss, values

        payloads = run_microbatches(self.model, mbs, loss_callback, self.arch.vocab_size, forward_only=False)
        local: dict[str, float] = {}
        if self._is_loss_rank():
            for payload in payloads:
                for key, value in payload.items():
                    combine(local, key, value)
        return combine_over_ranks(local)

    def _optimizer_step(self) -> float:
        """Step on the finalised grads (clipping included); returns the gradient norm."""
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:  # clipping disabled: Megatron skips the norm, report it anyway
            grad_norm = self.optimizer.get_grad_norm()
        return float(grad_norm)

    # ----------------------------------------------------------------- checkpoints
    @with_training_state
    def save_checkpoint(self, directory: str) -> None:
        """Write policy, reference, optimizer and RNG state into ``directory/megatron`` with
        Megatron's dist_checkpointing (loads at any layout; ``training/dist_checkpoint.py``).
        ``directory`` must exist on every rank; the caller makes the step atomic. Collective."""
        save_trainer_state(directory, model=self.model, optimizer=self.optimizer, reference=self.reference,
                           steps_done=self.steps_done, distributed_optimizer=self.cfg.parallel.use_distributed_optimizer)

    @with_training_state
    def load_checkpoint(self, directory: str) -> dict:
        """Restore a :meth:`save_checkpoint` step directory at this run's layout, whatever layout
        saved it (call after :meth:`load_hf`, which builds model and optimizer); a LEGACY per-rank
        checkpoint (``megatron_rank*.pt``) only at its own. Collective. Returns ``steps_done`` and,
        for dist checkpoints, ``saved_layout`` and ``rng_restored`` (see dist_checkpoint)."""
        if is_legacy(directory):
            info: dict = {"steps_done": load_legacy(self, directory)}
        else:
            info = load_trainer_state(directory, model=self.model, optimizer=self.optimizer, reference=self.reference,
                                      distributed_optimizer=self.cfg.parallel.use_distributed_optimizer)
        self.steps_done = info["steps_done"]
        self._accumulated = None  # gradients of the abandoned step mean nothing for the restored one
        return info

    def shutdown(self, destroy_world: bool = True) -> None:
        """Free the models and tear down Megatron's parallel state (and the world, by default)."""
        self.shutdown_weight_pushes()  # rings out of /dev/shm, push groups left
        self.model = self.reference = self.optimizer = None
        self._accumulated, self._offload = None, TrainerOffload()  # drop host copies too
        destroy_process_groups(destroy_world=destroy_world)

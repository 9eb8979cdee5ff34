"""The trainer rank's gradient steps: an ordinary step over a whole batch (:meth:`GradientSteps.train_step`)
and the streamed one, whose gradient is accumulated chunk by chunk
(:meth:`GradientSteps.accumulate_gradients`) and applied once (:meth:`GradientSteps.apply_accumulated_gradients`).
See :mod:`megatron_rl.training.megatron_worker` for the gradient contract both keep. A mixin of
:class:`~megatron_rl.training.megatron_worker.MegatronWorker` (it uses the worker's ``cfg``, ``rank``,
``model``, ``optimizer``, ``arch``, ``dp_size``, ``steps_done`` and ``_my_microbatches``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_rl.runtime.fault_injection import fault_point_in_backward
from megatron_rl.sample import Sample
from megatron_rl.training.logprobs import run_microbatches
from megatron_rl.training.memory_offload import with_training_state
from megatron_rl.training.packing import Microbatch
from megatron_rl.training.step_metrics import LOSS_METRICS, TOKEN_METRICS, combine, combine_over_ranks, parity_metrics

# loss_fn(logprobs, old_logprobs, advantages, mask, *, ref_logprobs, engine_logprobs, seq_ids,
#         num_tokens_total, num_seqs_total[, staleness]) -> (loss, metrics); the signature of
# megatron_rl.algorithms.losses.compute_policy_loss with ``cfg`` bound (functools.partial).
LossFn = Callable[..., tuple[torch.Tensor, dict]]


@dataclass
class Accumulation:
    """Gradients accumulated since the last optimizer step (see accumulate_gradients)."""

    metrics: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    time_s: float = 0.0
    torch_threads: int = 0  # the most torch threads a chunk was computed with
    failed: str = ""  # a chunk died mid-schedule: the buffers hold part of it


class GradientSteps:
    """Collective training methods of a trainer rank."""

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
    def accumulate_gradients(self, samples: list[Sample], loss_fn: LossFn, own: bool = False) -> dict[str, float]:
        """Forward+backward over this rank's share of ``samples``, adding to the gradient of the
        step :meth:`apply_accumulated_gradients` will take; no optimizer step.

        ``own=False``: every rank is called with the same chunk and each DP rank takes its share
        (balanced by tokens, as :meth:`train_step` does). ``own=True``: ``samples`` are this rank's DP
        replica's own share (the driver split the chunk over the replicas that train it,
        ``PolicyGroup.accumulate_gradients``), and only that replica's ranks are called: a replica whose
        GPUs the rollout freed trains while the others stay out of device memory. Either way nothing
        here talks to another DP replica: the first call after an optimizer step zeroes this rank's
        gradients, the grad finalisation (DP all-reduce, tied-embedding sync) is skipped (it must run
        once, over the complete sums), and ``loss_fn`` gets ``num_tokens_total=num_seqs_total=1`` (the
        batch totals are not known yet), so every loss and metric is a raw sum; the apply call
        normalises. A DP rank without samples skips the compute. Needs ``algorithm.ppo_mini_batches
        == 1``. Returns this rank's raw metrics of the chunk (empty but on one rank per replica, the
        one that reports: ``PolicyGroup`` adds them up).
        """
        from megatron.core.utils import get_model_config

        if self.cfg.algorithm.ppo_mini_batches != 1:
            raise ValueError(f"accumulate_gradients needs algorithm.ppo_mini_batches == 1 (one optimizer step "
                             f"per batch), got {self.cfg.algorithm.ppo_mini_batches}")
        if self._accumulated is not None and self._accumulated.failed:
            raise RuntimeError(f"accumulate_gradients: an earlier chunk failed ({self._accumulated.failed}); "
                               "call discard_accumulated_gradients")
        start = time.perf_counter()
        # Bad samples raise here, before any compute.
        mine, mbs = self._own_microbatches(samples) if own else self._my_share(samples)
        if self._accumulated is None:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._accumulated = Accumulation()
        acc = self._accumulated
        self.model.train()
        config = get_model_config(self.model)
        finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
        try:
            raw = self._forward_backward(mbs, loss_fn, 1, 1, over_ranks=False)
        except BaseException as exc:  # part of the chunk may be in the buffers: poison the step
            acc.failed = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            config.finalize_model_grads_func = finalize
        for key, value in raw.items():
            combine(acc.metrics, key, value)
        acc.samples += len(mine)
        acc.tokens += sum(len(samples[i].response_ids) for i in mine)
        acc.time_s += time.perf_counter() - start
        acc.torch_threads = max(acc.torch_threads, torch.get_num_threads())
        return raw

    def _my_share(self, samples: list[Sample]) -> tuple[list[int], list[Microbatch]]:
        """This DP rank's share of a chunk every rank got (indices into ``samples``) and its microbatches."""
        from megatron_rl.training.rank_batches import rank_share

        return rank_share([s.num_tokens for s in samples], self.dp_rank, self.dp_size), \
            self._my_microbatches(samples, fields=True)

    def _own_microbatches(self, samples: list[Sample]) -> tuple[list[int], list[Microbatch]]:
        """All of ``samples`` (this replica's own share) as this rank's microbatches."""
        from megatron_rl.training.rank_batches import rank_microbatches

        mine = list(range(len(samples)))
        return mine, rank_microbatches(samples, mine, self.cfg, self.layout.tensor_model_parallel_size, True)

    @with_training_state
    def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict[str, float]:
        """One optimizer step on everything :meth:`accumulate_gradients` added since the last.

        A rank whose replica trained nothing this step (no chunk reached it) contributes zeros. The
        ranks first add up what they accumulated (one collective; a chunk that failed on any rank
        makes every rank refuse, so none waits in a reduce the failed one never joins), then run the
        grad finalisation once, scale the gradient by 1/N (N = ``num_tokens_total`` for
        ``algorithm.loss_agg`` token_mean, else ``num_seqs_total``: the full batch's response tokens
        and sequences) and step (with clipping). Returns the raw metrics normalised as
        :meth:`train_step` reports them (loss, pg_loss, kl_loss / N; token metrics / num_tokens_total;
        counts unchanged) plus grad_norm, lr, tokens, optimizer_steps=1, time_s (the slowest
        replica's accumulate calls plus this one) and torch_threads (the most any rank computed with).
        Collective: every rank calls it.
        """
        from megatron.core.distributed import finalize_model_grads

        if num_tokens_total <= 0 or num_seqs_total <= 0:
            raise ValueError(f"num_tokens_total={num_tokens_total} and num_seqs_total={num_seqs_total} must be > 0")
        start = time.perf_counter()
        acc = self._accumulated or Accumulation()
        local = dict(acc.metrics)
        if self._is_loss_rank():  # one rank per replica counts the replica's samples
            local.update({"__samples": float(acc.samples), "__tokens": float(acc.tokens)})
        local.update({"__failed_max": float(bool(acc.failed)), "__time_s_max": acc.time_s,
                      "__torch_threads_max": float(max(acc.torch_threads, torch.get_num_threads()))})
        total = combine_over_ranks(local)
        if total.pop("__failed_max"):
            raise RuntimeError(f"apply_accumulated_gradients: a chunk failed ({acc.failed or 'on another rank'}); "
                               "call discard_accumulated_gradients")
        if not total.pop("__samples", 0.0):
            raise RuntimeError("apply_accumulated_gradients: nothing accumulated since the last optimizer step")
        if self._accumulated is None:  # this replica trained nothing: its share of the sum is zero
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        tokens, slowest, threads = total.pop("__tokens"), total.pop("__time_s_max"), total.pop("__torch_threads_max")
        norm = num_tokens_total if self.cfg.algorithm.loss_agg == "token_mean" else num_seqs_total
        finalize_model_grads([self.model], None)
        self.model.scale_gradients(1.0 / norm)
        grad_norm = self._optimizer_step()
        self._accumulated = None
        self.steps_done += 1
        out = {key: value / norm if key in LOSS_METRICS else value / num_tokens_total if key in TOKEN_METRICS
               else value for key, value in total.items()}
        out.update({"grad_norm": grad_norm, "lr": self.cfg.optimizer.lr, "tokens": tokens,
                    "optimizer_steps": 1.0, "time_s": slowest + time.perf_counter() - start,
                    "torch_threads": threads})
        return out

    def discard_accumulated_gradients(self) -> None:
        """Forget what :meth:`accumulate_gradients` added (the next call starts from zero)."""
        self._accumulated = None

    def _forward_backward(self, mbs: list[Microbatch], loss_fn: LossFn, num_tokens_total: int,
                          num_seqs_total: int, over_ranks: bool = True) -> dict[str, float]:
        """Run this DP rank's microbatches forward and backward into the grad buffers with the
        given loss normalisers; return the loss metrics summed over microbatches and, with
        ``over_ranks`` (a collective of every rank), over the ranks; else this rank's own (one rank
        per replica reports)."""

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
        return combine_over_ranks(local) if over_ranks else local

    def _optimizer_step(self) -> float:
        """Step on the finalised grads (clipping included); returns the gradient norm."""
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:  # clipping disabled: Megatron skips the norm, report it anyway
            grad_norm = self.optimizer.get_grad_norm()
        return float(grad_norm)

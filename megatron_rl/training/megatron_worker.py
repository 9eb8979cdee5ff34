"""MegatronWorker: one trainer rank holding the policy (and optional frozen reference) model.

A plain class; the driver wraps it as a Ray actor and calls every method on all ranks (SPMD),
always with the same arguments. Each rank takes its data-parallel share of the samples itself.

Gradient contract of :meth:`train_step`: the loss callable returns a microbatch loss already
divided by the FULL mini-batch's token (or sequence) count, so the sum of microbatch losses over
all microbatches and DP ranks is the mini-batch loss. Megatron is configured not to rescale
anything: ``calculate_per_token_loss=True`` (no division by the number of microbatches, DDP
sums rather than averages over DP) and a finalize hook that skips the per-token division. The
gradient is therefore that of the full mini-batch loss whatever the microbatching, PP or DP.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_rl.config import RunConfig
from megatron_rl.distributed.cpu_shim import with_cpu_device_mode
from megatron_rl.distributed.process_groups import (
    ParallelLayout,
    destroy_process_groups,
    init_distributed,
    init_model_parallel,
)
from megatron_rl.model.qwen2 import build_gpt_model, build_transformer_config, read_qwen2_arch
from megatron_rl.sample import Sample
from megatron_rl.training.logprobs import run_microbatches
from megatron_rl.training.packing import Microbatch, balance_across_ranks, build_microbatch, pack_microbatches, response_values
from megatron_rl.training.weights_io import gather_hf_state_dict, load_hf_into_model, local_tensors

# loss_fn(logprobs, old_logprobs, advantages, mask, *, ref_logprobs, engine_logprobs, seq_ids,
#         num_tokens_total, num_seqs_total) -> (loss, metrics); the signature of
# megatron_rl.algorithms.losses.compute_policy_loss with ``cfg`` bound (functools.partial).
LossFn = Callable[..., tuple[torch.Tensor, dict]]


def _finalize_grads_without_token_scaling(model: list, num_tokens: Any, *args: Any, **kwargs: Any) -> None:
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) without dividing by the
    token count: our losses are already normalised by the full batch."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, *args, **kwargs)


def _optional_field(samples: list[Sample], name: str) -> list[list[float]] | None:
    """Per-sample list field, None when no sample has it; an error when only some do."""
    present = [bool(getattr(s, name)) or not s.response_ids for s in samples]
    if not any(bool(getattr(s, name)) for s in samples):
        return None
    if not all(present):
        bad = present.index(False)
        raise ValueError(f"sample {bad} ({samples[bad].prompt.prompt_id}) has no {name} while others do")
    return [list(getattr(s, name)) for s in samples]


class MegatronWorker:
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

    # ----------------------------------------------------------------- set-up
    def _build(self, trainable: bool) -> torch.nn.Module:
        from megatron.core import parallel_state as ps

        tcfg = build_transformer_config(
            self.arch, self.cfg.model.dtype, self.layout.tensor_model_parallel_size,
            self.layout.pipeline_model_parallel_size, self.cfg.parallel.sequence_parallel,
        )
        model = build_gpt_model(
            self.arch, tcfg, self.layout.tensor_model_parallel_size,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            transformer_impl=self.cfg.model.transformer_impl,
        )
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
        shard_args = (self.arch, self.tp_rank, self.layout.tensor_model_parallel_size,
                      self.pp_rank, self.layout.pipeline_model_parallel_size)
        self.model = self._build(trainable=True)
        self._load_weights(self.model, hf_path, shard_args)
        self.optimizer = self._build_optimizer()
        # The optimizer may keep fp32 master copies: refresh them from the loaded weights.
        self.optimizer.reload_model_params()
        if self.cfg.model.use_reference_model or self.cfg.algorithm.kl_coef > 0:
            self.reference = self._build(trainable=False)
            self._load_weights(self.reference, hf_path, shard_args)

    def _load_weights(self, model: torch.nn.Module, hf_path: str, shard_args: tuple) -> None:
        """This rank's shard from ``model.megatron_checkpoint`` when set, else from ``hf_path``."""
        directory = self.cfg.model.megatron_checkpoint
        if not directory:
            load_hf_into_model(model, hf_path, *shard_args)
            return
        from megatron_rl.resharding.checkpoint_format import load_shard_into_model, read_converted_shard

        tp, pp = self.layout.tensor_model_parallel_size, self.layout.pipeline_model_parallel_size
        shard = read_converted_shard(directory, self.tp_rank, self.pp_rank, tp, pp)
        load_shard_into_model(model, shard, f"model.megatron_checkpoint {directory} (tp {self.tp_rank}, pp {self.pp_rank})")

    # ----------------------------------------------------------------- batching
    def _my_microbatches(self, samples: list[Sample], fields: bool) -> list[Microbatch]:
        """This DP rank's share of ``samples`` as padded microbatches (indices refer to ``samples``)."""
        lengths = [s.num_tokens for s in samples]
        mine = balance_across_ranks(lengths, self.dp_size)[self.dp_rank]
        groups = pack_microbatches([lengths[i] for i in mine], self.cfg.optimizer.micro_batch_tokens)
        token_fields: dict[str, list[list[float]] | None] = {}
        seq_fields: dict[str, list[float]] = {}
        if fields:
            for i, s in enumerate(samples):
                if s.response_ids and len(s.old_logprobs) != len(s.response_ids):
                    raise ValueError(
                        f"sample {i} ({s.prompt.prompt_id}, response {s.response_index}): old_logprobs has "
                        f"{len(s.old_logprobs)} values for {len(s.response_ids)} response tokens"
                    )
            token_fields = {"old_logprobs": [list(s.old_logprobs) for s in samples],
                            "ref_logprobs": _optional_field(samples, "ref_logprobs"),
                            "engine_logprobs": _optional_field(samples, "engine_logprobs")}
            seq_fields = {"advantages": [s.advantage for s in samples]}
        out = []
        for group in groups:
            idx = [mine[j] for j in group]
            out.append(build_microbatch(
                [(samples[i].prompt.token_ids, samples[i].response_ids) for i in idx], idx,
                token_fields={k: [v[i] for i in idx] for k, v in token_fields.items() if v is not None},
                seq_fields={k: [v[i] for i in idx] for k, v in seq_fields.items()},
            ))
        return out

    def _is_loss_rank(self) -> bool:
        # One rank per DP replica reports results: the last PP stage's TP rank 0.
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage() and self.tp_rank == 0

    # ----------------------------------------------------------------- logprobs
    @with_cpu_device_mode
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
    @with_cpu_device_mode
    def train_step(self, samples: list[Sample], loss_fn: LossFn) -> dict[str, float]:
        """``algorithm.ppo_mini_batches`` optimizer steps over ``samples`` (split in order).

        ``loss_fn`` is called per microbatch with [B, L] tensors (see ``LossFn``); its loss must
        be normalised by the mini-batch totals it is given. Returns mean loss-metrics over
        mini-batches (each summed over microbatches and DP ranks), grad norm, lr, tokens, time.
        """
        start = time.perf_counter()
        n_mini = self.cfg.algorithm.ppo_mini_batches
        if len(samples) < n_mini * self.dp_size:
            raise ValueError(f"{len(samples)} samples cannot fill algorithm.ppo_mini_batches={n_mini} "
                             f"x data_parallel_size={self.dp_size}")
        bounds = [round(k * len(samples) / n_mini) for k in range(n_mini + 1)]
        totals: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            metrics, grad_norm = self._mini_batch_step(samples[lo:hi], loss_fn)
            grad_norms.append(grad_norm)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value / n_mini
        self.steps_done += 1
        totals.update({
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.cfg.optimizer.lr,
            "tokens": float(sum(len(s.response_ids) for s in samples)),
            "optimizer_steps": float(n_mini),
            "time_s": time.perf_counter() - start,
        })
        return totals

    def _mini_batch_step(self, samples: list[Sample], loss_fn: LossFn) -> tuple[dict[str, float], float]:
        num_tokens_total = sum(len(s.response_ids) for s in samples)
        mbs = self._my_microbatches(samples, fields=True)

        def loss_callback(batch: Microbatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, Any]:
            loss, metrics = loss_fn(
                logprobs, batch.fields["old_logprobs"], batch.fields["advantages"], batch.loss_mask,
                ref_logprobs=batch.fields.get("ref_logprobs"), engine_logprobs=batch.fields.get("engine_logprobs"),
                seq_ids=batch.segment_ids, num_tokens_total=num_tokens_total, num_seqs_total=len(samples),
            )
            values = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in metrics.items()}
            values.setdefault("loss", float(loss.detach()))
            return loss, values

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        payloads = run_microbatches(self.model, mbs, loss_callback, self.arch.vocab_size, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:  # clipping disabled: Megatron skips the norm, report it anyway
            grad_norm = self.optimizer.get_grad_norm()
        local: dict[str, float] = {}
        if self._is_loss_rank():
            for payload in payloads:
                for key, value in payload.items():
                    local[key] = local.get(key, 0.0) + value
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
        summed: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                summed[key] = summed.get(key, 0.0) + value
        return summed, float(grad_norm)

    # ----------------------------------------------------------------- weights out
    @with_cpu_device_mode
    def export_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named fp32 state dict of the policy on global rank 0 (None elsewhere);
        includes ``lm_head.weight`` even when tied (vLLM's CPU reload needs it). Collective."""
        return gather_hf_state_dict(local_tensors(self.model), self.arch, include_tied_lm_head=True)

    @with_cpu_device_mode
    def export_hf_grads(self) -> dict[str, torch.Tensor] | None:
        """The last mini-batch's gradient (DP-summed, tied embeddings synced), HF-named on rank 0
        (None elsewhere). Raw only when ``optimizer.grad_clip`` is 0: clipping scales it in place.
        For parity checks and debugging. Collective."""
        grads = local_tensors(self.model, pick=lambda p: getattr(p, "main_grad", None))
        return gather_hf_state_dict(grads, self.arch, include_tied_lm_head=False)

    # ----------------------------------------------------------------- checkpoints
    def _rank_file(self, directory: str | Path) -> Path:
        return Path(directory) / f"megatron_rank{torch.distributed.get_rank():05d}.pt"

    @with_cpu_device_mode
    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's model, optimizer and RNG state into ``directory`` (which must exist;
        the caller makes the directory swap atomic). Collective with the distributed optimizer."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
            "layout": self.layout, "world_size": torch.distributed.get_world_size(),
            "steps_done": self.steps_done,
        }
        torch.save(state, self._rank_file(directory))
        if self.cfg.parallel.use_distributed_optimizer:
            self.optimizer.save_parameter_state(str(Path(directory) / f"optim_tp{self.tp_rank}_pp{self.pp_rank}.pt"))

    @with_cpu_device_mode
    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same world size and layout; call after
        :meth:`load_hf`, which builds the model and optimizer)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        path = self._rank_file(directory)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: no {path.name} for rank {torch.distributed.get_rank()}")
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["layout"] != self.layout or state["world_size"] != torch.distributed.get_world_size():
            raise ValueError(f"checkpoint {directory} was written with {state['layout']} on "
                             f"{state['world_size']} ranks, not {self.layout} on {torch.distributed.get_world_size()}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.cfg.parallel.use_distributed_optimizer:
            self.optimizer.load_parameter_state(str(Path(directory) / f"optim_tp{self.tp_rank}_pp{self.pp_rank}.pt"))
        torch.set_rng_state(state["rng"]["cpu"])
        get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.steps_done = state["steps_done"]

    def shutdown(self, destroy_world: bool = True) -> None:
        """Free the models and tear down Megatron's parallel state (and the world, by default)."""
        self.model = self.reference = self.optimizer = None
        destroy_process_groups(destroy_world=destroy_world)

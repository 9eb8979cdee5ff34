"""Building the trainer rank's models and loading them: the policy (Megatron DDP) and its optimizer,
the frozen reference, their weights from Hugging Face or a Megatron checkpoint, and the trainer's own
checkpoints through ``dist_checkpointing``. A mixin of
:class:`~megatron_rl.training.megatron_worker.MegatronWorker` (it uses and sets the worker's ``cfg``,
``layout``, ``tp_rank``, ``pp_rank``, ``arch``, ``hf_path``, ``model``, ``reference``, ``optimizer``,
``steps_done`` and its pending-gradient and offload state)."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl.distributed.cpu_shim import with_cpu_device_mode
from megatron_rl.model.qwen2 import build_gpt_model, build_transformer_config, read_qwen2_arch
from megatron_rl.training.dist_checkpoint import load_model_weights, load_trainer_state, save_trainer_state
from megatron_rl.training.legacy_checkpoint import is_legacy, load_legacy
from megatron_rl.training.memory_offload import TrainerOffload, with_training_state
from megatron_rl.training.weights_io import load_hf_into_model


def _finalize_grads_without_token_scaling(model: list, num_tokens: Any, *args: Any, **kwargs: Any) -> None:
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) without dividing by the
    token count: our losses are already normalised by the full batch."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, *args, **kwargs)


class ModelLoading:
    """Model and optimizer set-up, weight loading and checkpoints of a trainer rank."""

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

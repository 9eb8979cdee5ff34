"""torch.distributed + Megatron-Core parallel-state set-up and teardown for trainer ranks.

gloo on CPU (with the CPU shim applied), nccl on GPUs. The torch.distributed world and the
Megatron model-parallel layout are separate steps so one world can host several layouts in
turn (tests compare TP/PP layouts inside one set of processes; a re-layout does not need new
processes).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from megatron_rl.distributed.cpu_shim import apply_cpu_shim, cpu_device_mode, shim_needed


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron model-parallel sizes; DP is whatever is left of the world."""

    tensor_model_parallel_size: int = 1
    """TP size."""
    pipeline_model_parallel_size: int = 1
    """PP size."""
    context_parallel_size: int = 1
    """CP size (> 1 needs Transformer Engine on GPUs)."""

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises if the layout does not divide the world."""
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP x CP = {model_parallel} "
                f"(parallel.tensor_model_parallel_size={self.tensor_model_parallel_size}, "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}, "
                f"context_parallel_size={self.context_parallel_size})"
            )
        return world_size // model_parallel


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600.0
) -> str:
    """Join the torch.distributed world (no-op if already joined); returns the backend.

    gloo without a GPU (and the CUDA->CPU shim is applied), nccl with one (the rank's local
    GPU is ``rank % device_count``).
    """
    if shim_needed():
        apply_cpu_shim()
        backend = "gloo"
    else:
        backend = "nccl"
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world_size or torch.distributed.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {torch.distributed.get_rank()} of "
                f"{torch.distributed.get_world_size()}, not rank {rank} of {world_size}"
            )
        return torch.distributed.get_backend()
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    torch.distributed.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def init_model_parallel(layout: ParallelLayout, seed: int) -> None:
    """(Re)build Megatron's parallel state for ``layout`` and seed its RNG tracker.

    Any previous layout is destroyed first. Refuses CP > 1 on CPU (it needs Transformer Engine).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if layout.context_parallel_size > 1 and shim_needed():
        raise ValueError("parallel.context_parallel_size > 1 needs Transformer Engine on GPUs; use 1 on CPU")
    layout.data_parallel_size(torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with cpu_device_mode():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
        )
        model_parallel_cuda_manual_seed(seed)


def destroy_process_groups(destroy_world: bool = True) -> None:
    """Tear down Megatron's parallel state and (unless ``destroy_world`` is False) the world."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_world and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""LEGACY trainer checkpoints: one ``torch.save`` per Megatron rank (the format before
``megatron_rl/training/dist_checkpoint.py``). Read-only in the trainer.

A legacy step directory holds ``megatron_rank{r:05d}.pt`` per global rank with the wrapped
model's ``state_dict()``, the optimizer's ``state_dict()``, the RNG states, the
``ParallelLayout``, the world size and the step counter (plus ``optim_tp{t}_pp{p}.pt`` per
model-parallel rank with the distributed optimizer). The files are tied to the exact layout
that wrote them, so :func:`load_legacy` refuses any other TP/PP/CP or world size; resuming
once at the old layout and saving again writes the layout-independent format.

:func:`save_legacy` is kept only so that tests can produce a checkpoint of the old format and
``megatron_rl/benchmarks/benchmark_checkpoint.py`` can time both formats side by side; the trainer never calls it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.store import CheckpointError

LEGACY_GLOB = "megatron_rank*.pt"


def rank_file(directory: str | Path, rank: int | None = None) -> Path:
    """``directory/megatron_rank{r:05d}.pt`` of ``rank`` (default: this process's global rank)."""
    rank = torch.distributed.get_rank() if rank is None else rank
    return Path(directory) / f"megatron_rank{rank:05d}.pt"


def is_legacy(directory: str | Path) -> bool:
    """True when ``directory`` holds per-rank legacy checkpoint files."""
    return any(Path(directory).glob(LEGACY_GLOB))


def _optim_file(directory: str | Path, tp_rank: int, pp_rank: int) -> Path:
    return Path(directory) / f"optim_tp{tp_rank}_pp{pp_rank}.pt"


def save_legacy(worker: Any, directory: str | Path) -> None:
    """Write ``worker``'s (a MegatronWorker's) model, optimizer and RNG state as this rank's
    legacy file in ``directory`` (which must exist). Collective with the distributed optimizer."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "model": worker.model.state_dict(),
        "optimizer": worker.optimizer.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        "layout": worker.layout, "world_size": torch.distributed.get_world_size(),
        "steps_done": worker.steps_done,
    }
    torch.save(state, rank_file(directory))
    if worker.cfg.parallel.use_distributed_optimizer:
        worker.optimizer.save_parameter_state(str(_optim_file(directory, worker.tp_rank, worker.pp_rank)))


def load_legacy(worker: Any, directory: str | Path) -> int:
    """Restore a legacy checkpoint into ``worker`` (built by ``load_hf`` at the layout and world
    size that wrote it); returns the saved step counter. Any other layout is refused with a
    :class:`CheckpointError` that says how to get a layout-independent checkpoint."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    path = rank_file(directory)
    world = torch.distributed.get_world_size()
    if not path.is_file():
        raise CheckpointError(f"legacy checkpoint {directory}: no {path.name} for rank {torch.distributed.get_rank()} "
                              f"(it was written on fewer ranks than this run's {world})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != worker.layout or state["world_size"] != world:
        raise CheckpointError(
            f"legacy checkpoint {directory} (one torch.save file per rank) was written with {state['layout']} on "
            f"{state['world_size']} ranks, not {worker.layout} on {world}; the legacy format only resumes at its "
            "own layout: resume once with that layout (parallel.* and world size as saved), let it save a "
            "checkpoint (the layout-independent dist_checkpointing format), then change the layout")
    worker.model.load_state_dict(state["model"])
    worker.optimizer.load_state_dict(state["optimizer"])
    if worker.cfg.parallel.use_distributed_optimizer:
        worker.optimizer.load_parameter_state(str(_optim_file(directory, worker.tp_rank, worker.pp_rank)))
    torch.set_rng_state(state["rng"]["cpu"])
    get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return int(state["steps_done"])

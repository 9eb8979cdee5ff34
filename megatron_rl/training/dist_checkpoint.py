"""Trainer checkpoints through ``megatron.core.dist_checkpointing``: one checkpoint, any layout.

Every trainer rank calls :func:`save_trainer_state` / :func:`load_trainer_state` (collectives).
The tensors are written as global tensors in Megatron's ``torch_dist`` format (PyTorch
Distributed Checkpoint underneath), so a checkpoint saved at one ``parallel.*`` layout (TP, PP,
DP, world size) loads at any other: each rank reads the slices its new shards need. Saving and
loading are fully parallel (``FullyParallelSaveStrategyWrapper`` /
``FullyParallelLoadStrategyWrapper`` over the data-parallel group): DP replicas split the
writing and the reading instead of DP rank 0 doing it all.

Inside a step directory of ``megatron_rl/checkpoint/store.py``::

    step_000123/
        manifest.json, driver_state.pt   the driver's (CheckpointManager.commit)
        megatron/                        this module: one torch_dist checkpoint of all ranks
            .metadata, __<r>_<t>.distcp  the tensors, one file per (saving rank, writer thread)
            common.pt                    rank 0's plain state: format, layout, step counter,
                                         optimizer hyper-parameters
            metadata.json                written last, after a barrier: a torn save has none

Sharded keys: the policy's ``GPTModel.sharded_state_dict()`` keys (layers stacked on a leading
axis, TP shards as slices of the full tensor, the vocabulary padding allowed to differ), the
frozen reference model's under ``reference.``, Adam's moments (and fp32 masters with bf16
weights) under ``optimizer.state.*`` and the RNG states under ``rng_state``. A checkpoint of
``megatron-rl-convert-checkpoint hf-to-megatron`` holds the same model keys and nothing else.

RNG across layout changes: the RNG states (torch CPU, CUDA, Megatron's model-parallel tracker)
are one object per (PP, TP) coordinate, shared by the DP replicas (they are seeded alike). A
resume with the same TP and PP (DP and world size may change) restores them exactly; a TP or PP
change keeps the states ``init_model_parallel`` seeded from ``trainer.seed`` (as a fresh run at
the new layout has) and logs that, as Megatron-LM does. Nothing in training draws from them
today (dropout is off, rollout sampling has its own seeds), so the loss does not depend on it.

The distributed optimizer (``parallel.use_distributed_optimizer``, GPUs only) is written in
Megatron's ``fully_reshardable`` form (see :data:`DIST_OPT_SHARDING`).
"""
from __future__ import annotations

import logging
import queue
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.store import CheckpointError
from megatron_rl.resharding.checkpoint_format import TRAINER_SUBDIR as SUBDIR
from megatron_rl.resharding.checkpoint_format import find_dist_checkpoint
from megatron_rl.runtime.fault_injection import fault_point

log = logging.getLogger(__name__)

FORMAT = "megatron_rl.trainer_dist_checkpoint/v1"
INFO_KEY = "megatron_rl"
"""Common-state entry: {format, layout, steps_done, has_reference, distributed_optimizer}."""
REFERENCE_PREFIX = "reference."
DIST_OPT_SHARDING = "fully_reshardable"
"""``distrib_optim_sharding_type`` of the distributed optimizer's state. megatron-core 0.16.1
offers: ``fully_reshardable`` (canonical per-parameter tensors, any TP/PP/DP on load; the save
gathers each model-parallel group's state on its DP rank 0), ``dp_reshardable`` and the
deprecated ``dp_zero_gather_scatter`` (DP changes only), ``fully_sharded_model_space`` (fails in
0.16.1: "ShardedTensor.flattened_range is not supported"). Only the first fits this project."""
_RNG_KEY = "rng_state"
_MP_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def current_layout() -> dict[str, int]:
    """This process's Megatron layout and world size (what a checkpoint records)."""
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "world_size": torch.distributed.get_world_size(),
    }


def _innermost(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return model


def sharded_model_state(model: torch.nn.Module, prefix: str = "") -> dict:
    """Megatron's sharded state dict of a (possibly DDP / Float16Module-wrapped) GPTModel, keys
    prefixed by ``prefix``. The tensors are the model's own parameters (no copy)."""
    return _innermost(model).sharded_state_dict(prefix=prefix)


def _strategies() -> tuple[Any, Any]:
    """torch_dist save/load strategies, parallelised over the DP (x CP) group."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    group = ps.get_data_parallel_group(with_context_parallel=True)
    return (FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), group),
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group))


def _optimizer_metadata(distributed_optimizer: bool) -> dict:
    # chained_optim_avoid_prefix: several chained optimizers (param groups) share one key space,
    # as Megatron-LM writes it, so the split into optimizers may differ between runs.
    meta: dict[str, Any] = {"chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        meta["distrib_optim_sharding_type"] = DIST_OPT_SHARDING
    return meta


def _rng_object(data: Any) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject(_RNG_KEY, data, shape, offset, replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _capture_rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch_cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
            "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state["torch_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _inner_optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_trainer_state(directory: str | Path, *, model: torch.nn.Module, optimizer: Any,
                       reference: torch.nn.Module | None, steps_done: int, distributed_optimizer: bool) -> Path:
    """Write the policy, the reference (when given), the optimizer and the RNG states into
    ``directory/megatron`` (``directory`` must exist and be visible to every rank; an earlier
    ``megatron/`` there is replaced). Collective over all ranks; returns the written directory.
    ``metadata.json`` is written last, so an interrupted save never passes for a checkpoint."""
    from megatron.core import dist_checkpointing

    target = Path(directory) / SUBDIR
    if torch.distributed.get_rank() == 0:
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
    torch.distributed.barrier()
    model_sd = sharded_model_state(model)
    state: dict[str, Any] = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=_optimizer_metadata(distributed_optimizer)),
        "rng": _rng_object(_capture_rng()),
        INFO_KEY: {"format": FORMAT, "layout": current_layout(), "steps_done": int(steps_done),
                   "has_reference": reference is not None, "distributed_optimizer": bool(distributed_optimizer)},
    }
    if reference is not None:
        state["reference"] = sharded_model_state(reference, REFERENCE_PREFIX)
    save_strategy, _ = _strategies()
    _in_process_write_results()
    # Fault-injection tests kill a rank here: the others are inside the save, waiting for it.
    fault_point("checkpoint.save", step=int(steps_done), rank=torch.distributed.get_rank())
    dist_checkpointing.save(state, str(target), sharded_strategy=save_strategy)
    return target


def _in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process results queue before the first save.

    megatron-core 0.16.1 (``strategies.filesystem_async._get_write_results_queue``) creates that
    queue on a rank's first save through a spawned ``multiprocessing`` Manager: a server process
    that imports torch (~3 CPU s, ~250 MB) and lives as long as the rank (a SIGKILLed rank leaves
    it behind). The Manager is there for asynchronous saves, whose writer runs in another process.
    Ours are synchronous: ``dist_checkpointing.save`` runs the writer in this process
    (``AsyncRequest.execute_sync``), its forked per-bucket writers report through a queue of
    their own, and the writer puts the collected results on this queue for the same process to
    read, so a ``queue.Queue`` does the same job. Left alone when the module no longer has the
    global (another megatron-core) or a queue is already set."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def _load(request: dict, source: Path) -> dict:
    """dist_checkpointing.load of ``request``; keys absent from the checkpoint are an error
    except Transformer Engine's ``_extra_state`` (a local-spec checkpoint has none to give)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _, load_strategy = _strategies()
    loaded, _, absent = dist_checkpointing.load(request, str(source), sharded_strategy=load_strategy,
                                                strict=StrictHandling.RETURN_UNEXPECTED)
    absent = sorted(k for k in absent if not k.endswith("_extra_state"))
    if absent:
        raise CheckpointError(f"{source} lacks {len(absent)} tensors this model needs, e.g. {absent[:5]} "
                              "(a checkpoint of another architecture?)")
    return loaded


def _load_module(model: torch.nn.Module, state: dict, prefix: str, label: str) -> None:
    inner = _innermost(model)
    state = {k[len(prefix):]: v for k, v in state.items()}
    result = inner.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{label}: the loaded state does not match the model: missing {missing}, "
                              f"unexpected {result.unexpected_keys}")


def _prepare_distributed_optimizer(optimizer: Any) -> None:
    # torch's Adam creates its state at the first step; megatron-core 0.16.1's
    # DistributedOptimizer.state_dict() (called by sharded_state_dict(is_loading=True)) needs it.
    # Megatron's own dummy initialisation fills it; loading overwrites all of it.
    for inner in _inner_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _load_distributed_optimizer(optimizer: Any, state: Any) -> None:
    inners = _inner_optimizers(optimizer)
    states = [state] if len(inners) == 1 else [state[i] for i in range(len(inners))]
    for inner, inner_state in zip(inners, states):
        param_state = inner_state.pop("param_state")
        sharding = inner_state.pop("param_state_sharding_type")
        if sharding != DIST_OPT_SHARDING:
            raise CheckpointError(f"distributed optimizer state of type {sharding!r}, expected {DIST_OPT_SHARDING!r}")
        inner.load_state_dict(inner_state)  # hyper-parameters, step, grad scaler; allocates the buffers
        # Two megatron-core 0.16.1 bugs with torch's Adam (no TE/Apex), which keeps a 'step' per
        # parameter: load_state_dict gives every parameter the SAME step tensor (Adam's in-place
        # += 1 then counts every parameter, ruining the bias correction), and
        # load_parameter_state_from_fully_reshardable tries to copy 'step' from the checkpoint,
        # which has it only in the param groups (KeyError). Set it aside, then give each its own.
        steps = {p: s.pop("step") for p, s in inner.optimizer.state.items() if "step" in s}
        try:
            inner.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                inner.optimizer.state[p]["step"] = step.detach().clone()


def read_info(directory: str | Path) -> dict:
    """The ``megatron_rl`` entry of a trainer dist checkpoint (format, layout, steps_done, ...);
    raises :class:`CheckpointError` for a weights-only (converted) checkpoint."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    source = find_dist_checkpoint(directory)
    info = load_common_state_dict(str(source)).get(INFO_KEY)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{source} holds model weights only, no trainer state (a megatron-rl-convert-checkpoint "
                              "output?): start from it with model.megatron_checkpoint instead of resuming")
    return info


def load_trainer_state(directory: str | Path, *, model: torch.nn.Module, optimizer: Any,
                       reference: torch.nn.Module | None, distributed_optimizer: bool) -> dict:
    """Restore what :func:`save_trainer_state` wrote, at this process's layout (any TP, PP, DP,
    world size). Call after the model and optimizer are built. A reference model is restored
    when both the run and the checkpoint have one (otherwise it keeps its initial weights).
    Collective. Returns ``{"steps_done", "saved_layout", "rng_restored"}``."""
    source = find_dist_checkpoint(directory)
    info = read_info(source)
    if info["distributed_optimizer"] != bool(distributed_optimizer):
        raise CheckpointError(
            f"{source} was saved with parallel.use_distributed_optimizer={info['distributed_optimizer']}, this run "
            f"has {bool(distributed_optimizer)}: resume with the setting it was saved with")
    model_sd = sharded_model_state(model)
    if distributed_optimizer:
        _prepare_distributed_optimizer(optimizer)
    request: dict[str, Any] = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                  metadata=_optimizer_metadata(distributed_optimizer)),
    }
    now = current_layout()
    same_model_parallel = all(info["layout"][k] == now[k] for k in _MP_KEYS)
    if same_model_parallel:
        request["rng"] = _rng_object({})
    if reference is not None and info["has_reference"]:
        request["reference"] = sharded_model_state(reference, REFERENCE_PREFIX)
    loaded = _load(request, source)
    _load_module(model, loaded["model"], "", f"checkpoint {source} (policy)")
    if "reference" in loaded:
        _load_module(reference, loaded["reference"], REFERENCE_PREFIX, f"checkpoint {source} (reference)")
    if distributed_optimizer:
        _load_distributed_optimizer(optimizer, loaded["optimizer"])
    else:
        optimizer.load_state_dict(loaded["optimizer"])
    if same_model_parallel:
        _restore_rng(loaded["rng"])
    elif torch.distributed.get_rank() == 0:
        log.warning("checkpoint %s was saved at TP=%d PP=%d CP=%d, this run has TP=%d PP=%d CP=%d: RNG states keep "
                    "their trainer.seed initialisation (as in a fresh run at this layout)", source,
                    *(info["layout"][k] for k in _MP_KEYS), *(now[k] for k in _MP_KEYS))
    return {"steps_done": int(info["steps_done"]), "saved_layout": dict(info["layout"]),
            "rng_restored": same_model_parallel}


def load_model_weights(directory: str | Path, model: torch.nn.Module, label: str) -> None:
    """Load the policy weights of a dist checkpoint (converted by ``megatron-rl-convert-checkpoint``
    or a trainer step directory) into ``model`` at this process's layout. Collective."""
    source = find_dist_checkpoint(directory)
    loaded = _load({"model": sharded_model_state(model)}, source)
    _load_module(model, loaded["model"], "", f"{label} ({source})")

"""SPMD scenarios for the dist-checkpoint tests (test_dist_checkpoint.py), run by
``tests.helpers.megatron_cases.run_spmd``: save a trainer checkpoint at one layout, resume at another, and
compare with an uninterrupted run at the new layout.

Imported by the spawned ranks (spawn start method), so keep it free of pytest fixtures.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from tests.helpers.megatron_cases import make_samples, policy_loss_cfg, toy_loss

KILLED = 86
"""Exit status of the ranks killed in the middle of a save."""


def batch(seed: int, num: int = 10):
    """Random samples with fixed old_logprobs (so the toy loss does not depend on the model that
    scored them)."""
    samples = make_samples(num, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for s in samples:
        s.old_logprobs = (-5.0 + torch.randn(len(s.response_ids), generator=g)).tolist()
    return samples


def worker_cfg(tp: int, pp: int, reference: bool, distributed_optimizer: bool = False):
    cfg = policy_loss_cfg(tp, pp, "token_mean", 0.0, 0.0)
    cfg.model.use_reference_model = reference
    cfg.parallel.use_distributed_optimizer = distributed_optimizer
    return cfg


@contextlib.contextmanager
def pretend_cuda_params() -> Iterator[None]:
    """Make ``Tensor.type()`` name CUDA types. Megatron's DistributedOptimizer refuses CPU
    parameters only by that string (``torch.cuda.FloatTensor`` expected); while it is being
    built, this lets the real optimizer run on CPU. Test-only: the config still refuses
    ``parallel.use_distributed_optimizer`` on CPU for users."""
    original = torch.Tensor.type

    def cuda_named(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = cuda_named
    try:
        yield
    finally:
        torch.Tensor.type = original


def new_worker(cfg, rank: int, world: int, port: int, hf_dir: str):
    from megatron_rl.training.megatron_worker import MegatronWorker

    worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
    with pretend_cuda_params() if cfg.parallel.use_distributed_optimizer else contextlib.nullcontext():
        worker.load_hf(hf_dir)
    return worker


def adam_state(worker) -> dict | None:
    """Adam's exp_avg / exp_avg_sq gathered to full HF-named tensors (global rank 0; None
    elsewhere) and the set of step counters on this rank. Non-distributed optimizer only."""
    from megatron_rl.training.weights_io import gather_hf_state_dict, local_tensors

    state: dict = {}
    for inner in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        state.update(inner.optimizer.state)
    out = {key: gather_hf_state_dict(local_tensors(worker.model, pick=lambda p, key=key: state[p][key]),
                                     worker.arch, include_tied_lm_head=False)
           for key in ("exp_avg", "exp_avg_sq")}
    steps = {float(s["step"]) for s in state.values()}
    return {**out, "steps": steps} if out["exp_avg"] is not None else {"steps": steps}


def rng_snapshot() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch_cpu": torch.get_rng_state().clone(),
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def advance_rng() -> None:
    """Draw from every RNG so that saved states differ from freshly seeded ones."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.rand(13)
    with get_cuda_rng_tracker().fork():
        torch.rand(17)


def coords(worker) -> tuple[int, int, int]:
    return worker.pp_rank, worker.tp_rank, worker.dp_rank


def _from_rank0(value: Any) -> Any:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- scenarios
def save_then_die(rank: int, world: int, port: int, hf_dir: str, probe, run_dir: str, legacy_dir: str,
                  out_dir: str, layout: tuple[int, int]):
    """One step at ``layout``, a committed checkpoint step_000001 (rank 0 plays the driver with
    a CheckpointManager) and a legacy-format copy; then a second step whose save is killed
    (every rank exits with KILLED) after the tensor files are written and before the
    checkpoint's metadata. What was saved goes to ``out_dir/saved{rank}.pkl`` first."""
    from megatron_rl.checkpoint.store import CheckpointManager
    from megatron_rl.training.legacy_checkpoint import save_legacy

    worker = new_worker(worker_cfg(*layout, reference=True), rank, world, port, hf_dir)
    reference_logprobs = worker.compute_logprobs(probe, "reference")
    worker.train_step(batch(1), toy_loss)
    advance_rng()
    manager = CheckpointManager(run_dir, keep=2) if rank == 0 else None
    tmp = _from_rank0(str(manager.begin(1)) if rank == 0 else None)
    rng = rng_snapshot()
    worker.save_checkpoint(tmp)
    torch.distributed.barrier()
    if rank == 0:
        manager.commit(1, tmp, driver_state={"next_step": 1})
    save_legacy(worker, legacy_dir)
    saved = {"coords": coords(worker), "rng": rng, "weights": worker.export_hf_state_dict(),
             "adam": adam_state(worker), "reference_logprobs": reference_logprobs}
    with open(Path(out_dir) / f"saved{rank}.pkl", "wb") as handle:
        pickle.dump(saved, handle)
    torch.distributed.barrier()

    worker.train_step(batch(2), toy_loss)
    tmp2 = _from_rank0(str(manager.begin(2)) if rank == 0 else None)
    import megatron.core.dist_checkpointing.strategies.torch as torch_dist

    def die(*args: Any, **kwargs: Any) -> None:  # the .distcp files are written, nothing else yet
        for child in mp.active_children():  # the writer's queue manager would outlive us
            child.terminate()
        os._exit(KILLED)

    torch_dist.save_state_dict_async_finalize = die
    worker.save_checkpoint(tmp2)
    raise AssertionError("the save was not interrupted")


def _resume(rank: int, world: int, port: int, case: dict, probe) -> dict:
    """Uninterrupted two steps at the case's layout, then a worker started from another model
    that loads the checkpoint and takes the second step."""
    cfg = worker_cfg(case["tp"], case["pp"], case["reference"], case.get("distributed_optimizer", False))
    out: dict[str, Any] = {"label": case["label"]}
    base = new_worker(cfg, rank, world, port, case["hf"])
    base.train_step(batch(1), toy_loss)
    if not cfg.parallel.use_distributed_optimizer:
        out["base_adam"] = adam_state(base)
    out["base_metrics"] = base.train_step(batch(2), toy_loss)
    out["base_weights"] = base.export_hf_state_dict()
    base.shutdown(destroy_world=False)

    resumed = new_worker(cfg, rank, world, port, case["other_hf"])  # all weights must come from the checkpoint
    out["fresh_rng"] = rng_snapshot()
    out["info"] = resumed.load_checkpoint(case["checkpoint"])
    out["rng"], out["coords"] = rng_snapshot(), coords(resumed)
    out["weights"] = resumed.export_hf_state_dict()
    if not cfg.parallel.use_distributed_optimizer:
        out["adam"] = adam_state(resumed)
    if case["reference"]:
        out["reference_logprobs"] = resumed.compute_logprobs(probe, "reference")
    out["metrics"] = resumed.train_step(batch(2), toy_loss)
    out["weights_after"] = resumed.export_hf_state_dict()
    resumed.shutdown(destroy_world=False)
    return out


def _save(rank: int, world: int, port: int, case: dict) -> dict:
    """One step at the case's layout, saved into ``case['checkpoint']`` (a plain directory)."""
    cfg = worker_cfg(case["tp"], case["pp"], case["reference"], case.get("distributed_optimizer", False))
    worker = new_worker(cfg, rank, world, port, case["hf"])
    worker.train_step(batch(1), toy_loss)
    if rank == 0:
        os.makedirs(case["checkpoint"], exist_ok=True)
    torch.distributed.barrier()
    worker.save_checkpoint(case["checkpoint"])
    # The save's forked writers are joined; no helper process (megatron's Manager) stays behind.
    helpers = [p.name() for p in psutil.Process().children(recursive=True)]
    out = {"label": case["label"], "weights": worker.export_hf_state_dict(), "helpers_after_save": helpers}
    if not cfg.parallel.use_distributed_optimizer:
        out["adam"] = adam_state(worker)
    worker.shutdown(destroy_world=False)
    return out


def _refused(rank: int, world: int, port: int, case: dict) -> dict:
    """Loading the checkpoint must raise; returns the message."""
    worker = new_worker(worker_cfg(case["tp"], case["pp"], case["reference"]), rank, world, port, case["hf"])
    try:
        worker.load_checkpoint(case["checkpoint"])
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = ""
    worker.shutdown(destroy_world=False)
    return {"label": case["label"], "error": message}


def run_cases(rank: int, world: int, port: int, cases: list[dict], probe) -> list[dict]:
    """Run each case (``kind`` save / resume / refused) in turn on one set of ranks; every rank
    returns its results (weights and gathered moments are on rank 0 only)."""
    results = []
    for case in cases:
        if case["kind"] == "save":
            results.append(_save(rank, world, port, case))
        elif case["kind"] == "resume":
            results.append(_resume(rank, world, port, case, probe))
        else:
            results.append(_refused(rank, world, port, case))
    torch.distributed.destroy_process_group()
    return results


def device_check_on_cpu(rank: int, world: int, port: int, work_dir: str) -> dict:
    """tests/gpu/dist_optimizer_check.py's check, run here on CPU (world 1, fp32) with the
    distributed optimizer's CUDA-type check satisfied by :func:`pretend_cuda_params`."""
    from tests.gpu.dist_optimizer_check import check_distributed_optimizer_round_trip

    return check_distributed_optimizer_round_trip(work_dir, dtype="float32", build_context=pretend_cuda_params,
                                                  port=port)

"""Trainer memory during rollout (``trainer.offload_during_rollout``): release what the trainer
does not need while the colocated engines generate, and bring it back before the next logprob or
training call.

What :meth:`TrainerOffload.offload` does, per rank:

* gradient buffers: Megatron DDP's ``offload_grad_buffers`` resizes every fp32 grad buffer's
  storage to 0 bytes (the ``main_grad`` views stay valid objects); ``restore_grad_buffers``
  reallocates and zeroes them. Nothing is copied: the gradients of the last step are not needed
  again (the next step zeroes them anyway), so offloading discards them. This frees memory on
  the CPU as well as on the GPU.
* optimizer state (GPU only): Adam's moments and the fp32 master copies go to host memory and
  back to the device they came from. Not Megatron's ``optimizer.offload_to_cpu`` /
  ``restore_from_cpu``: those move every optimizer parameter, including fp32 model parameters
  that the optimizer steps in place (``p.data`` swapped away from the DDP parameter buffer it
  is a view of), and restore every CPU tensor to the GPU, including torch Adam's CPU ``step``
  counters. On the CPU "host memory" is where the state already lives: nothing to do.
* weights (GPU only): the parameters' storages (the DDP parameter buffer with the distributed
  optimizer, else each parameter's own), and the frozen reference model's, go to pinned host
  memory. On the CPU there is no device memory to free (and ``pin_memory`` needs CUDA), so the
  weights stay.

Every move is in place: the storage is copied to host bytes and resized to 0, and on reload
resized back and refilled, so every tensor keeps its identity, device and autograd state (see
:class:`TrainerOffload`).

The GPU parts can be forced on a CPU (``move_optimizer`` / ``move_weights``, unpinned CPU to
CPU copies) so that their bookkeeping is tested without a GPU.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

import torch

from megatron_rl.distributed.cpu_shim import cpu_device_mode

log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])
_HOST = torch.device("cpu")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _ddp_buffers(model: Any) -> list:
    return list(model.buffers) + list(getattr(model, "expert_parallel_buffers", []))


def grad_buffer_bytes(model: Any) -> int:
    """Bytes currently allocated for the DDP gradient buffers of ``model``."""
    return sum(_nbytes(b.grad_data) for b in _ddp_buffers(model))


def grad_accumulator_ids(model: Any) -> list[int]:
    """The identity of each trainable parameter's autograd grad accumulator, which Megatron's DDP
    hooks to add gradients into ``main_grad``: an offload must keep them (see TrainerOffload).
    Call it with the state in place (an emptied storage cannot be expanded)."""
    return [id(p.expand_as(p).grad_fn.next_functions[0][0]) for p in model.parameters() if p.requires_grad]


class TrainerOffload:
    """What :meth:`offload` moved away, so that :meth:`reload` puts back exactly that.

    Everything moves storage by storage: a moved tensor keeps its identity and its device, and
    only its storage is emptied (``resize_(0)``) and refilled. Replacing ``param.data`` with a
    host tensor instead would drop the parameter's autograd grad accumulator (torch resets it when
    the data changes device), and with it the hook Megatron's DDP registered there to add each
    gradient into ``main_grad``: after such a round trip the next step's gradients never reach the
    grad buffer (the H200 GPU check caught it: the plain optimizer's next step differed). A
    storage shared by several tensors (the DDP parameter buffer and its views) moves once."""

    def __init__(self) -> None:
        on_gpu = torch.cuda.is_available()
        self.move_optimizer = on_gpu
        self.move_weights = on_gpu
        self.pin = on_gpu
        self.active = False
        self.grads_only = False
        """Only the grad buffers are freed (:meth:`free_grad_buffers`); :meth:`offload` moves the rest."""
        self.auto_reloads = 0  # training calls that found the state offloaded (see with_training_state)
        self._model: Any = None
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor, str]] = []  # (emptied storage, host bytes, kind)
        self._moved_ptrs: set[int] = set()

    def free_grad_buffers(self, model: Any) -> int:
        """The first part of :meth:`offload` alone: free ``model``'s grad buffers (the last step's
        gradients are spent) while the weights stay, e.g. as the source of a weight push that
        then has their room. :meth:`offload` moves the rest, :meth:`reload` brings them back.
        Returns the bytes freed (0 when already offloaded)."""
        if self.active:
            return 0
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.synchronize()  # the last step's kernels may still read these buffers
        freed = grad_buffer_bytes(model)
        model.offload_grad_buffers(synchronize=False, empty_cache=False)
        self._model, self.active, self.grads_only = model, True, True
        if on_gpu:
            torch.cuda.empty_cache()
        return freed

    def offload(self, model: Any, optimizer: Any, reference: Any = None) -> dict[str, int]:
        """Free ``model``'s grad buffers; move optimizer state and weights to the host when
        enabled. Returns the bytes freed or moved per kind (0 for a kind left in place)."""
        if self.active and not self.grads_only:
            return {"grad_buffers_freed": 0, "optimizer_to_host": 0, "weights_to_host": 0}
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.synchronize()  # the last step's kernels may still read these buffers
        stats = {"grad_buffers_freed": 0 if self.active else grad_buffer_bytes(model), "optimizer_to_host": 0,
                 "weights_to_host": 0}
        if not self.active:
            # synchronize/empty_cache call torch.cuda, which a CPU-only torch rejects without the shim.
            model.offload_grad_buffers(synchronize=False, empty_cache=False)
        # Active from here: should a move below fail, reload still restores what was moved.
        self._model, self.active, self.grads_only = model, True, False
        if self.move_optimizer:  # before the weights: aliasing is judged on live storages
            stats["optimizer_to_host"] = self._move(_optimizer_tensors(model, optimizer), "optimizer")
        if self.move_weights:
            params = list(model.parameters()) + (list(reference.parameters()) if reference is not None else [])
            stats["weights_to_host"] = self._move(params, "weights")
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return stats

    def reload(self) -> dict[str, int]:
        """Undo :meth:`offload` (no-op when nothing is offloaded); grad buffers come back zeroed.
        Returns the bytes reallocated per kind."""
        if not self.active:
            return {"grad_buffers": 0, "optimizer": 0, "weights": 0}
        stats = {"grad_buffers": 0, "optimizer": 0, "weights": 0}
        for storage, host, kind in self._moved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=self.pin)
            stats[kind] += host.numel()
        self._model.restore_grad_buffers(synchronize=False)
        stats["grad_buffers"] = grad_buffer_bytes(self._model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # pinned copies are asynchronous: the host bytes must outlive them
        self._moved, self._moved_ptrs = [], set()
        self._model, self.active, self.grads_only = None, False, False
        return stats

    def _move(self, tensors: list[torch.Tensor], kind: str) -> int:
        """Copy each not yet moved storage of ``tensors`` to (pinned) host bytes and empty it."""
        moved = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            nbytes, ptr = storage.nbytes(), storage.data_ptr()
            if not nbytes or ptr in self._moved_ptrs:
                continue
            if not storage.resizable():
                raise RuntimeError(f"trainer.offload_during_rollout: a {kind} tensor {tuple(tensor.shape)} "
                                   f"{tensor.dtype} lives in a storage that cannot be resized, so its memory "
                                   "cannot be released in place")
            host = torch.empty(nbytes, dtype=torch.uint8, device=_HOST, pin_memory=self.pin)
            host.untyped_storage().copy_(storage)
            self._moved.append((storage, host, kind))
            self._moved_ptrs.add(ptr)
            storage.resize_(0)
            moved += nbytes
        return moved


def _optimizer_tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's own tensors: its parameters that are not model parameters (fp32 master
    copies) and its state (Adam's moments)."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tensors: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "is_stub_optimizer", False):
            continue
        for group in inner.param_groups:
            # An fp32 model parameter (or a shard view of one) that the optimizer steps in place
            # belongs to the model: it moves (once) with the weights.
            tensors += [p for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages]
        for state in inner.state.values():
            # torch Adam's scalar step counter stays where Adam expects it.
            tensors += [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    return tensors


def _reloading(weights_only: bool) -> Callable[[_F], _F]:
    """The decorators below: run the call in ``cpu_device_mode`` after reloading what ``offload_for_rollout``
    moved away (with ``weights_only``, only a full offload: freed grad buffers leave the weights in place)."""
    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with cpu_device_mode():
                if self._offload.active and not (weights_only and self._offload.grads_only):
                    log.warning("%s called while the trainer state is offloaded: reloading it first "
                                "(call reload_for_training before the logprob/training calls or the push)", fn.__name__)
                    self._offload.auto_reloads += 1
                    self._offload.reload()
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


with_training_state = _reloading(weights_only=False)
"""Decorator for the MegatronWorker methods that use weights, gradients or optimizer state: a forgotten
``reload_for_training`` costs time (and a warning), never a wrong result."""
with_weights = _reloading(weights_only=True)
"""As :data:`with_training_state`, for a method that reads only the weights (a weight push): the state a push
leaves before it (``free_grad_buffers``) is enough."""

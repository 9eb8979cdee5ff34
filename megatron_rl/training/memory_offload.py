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
  counters. Here an optimizer tensor moves only when it owns its storage, and comes back to its
  original device. On the CPU "host memory" is where the state already lives: nothing to do.
* weights (GPU only): the DDP parameter buffers (distributed optimizer) or else each parameter's
  data, and the frozen reference model's, go to pinned host memory and the device storage is
  resized to 0 / dropped. On the CPU there is no device memory to free (and ``pin_memory``
  needs CUDA), so the weights stay.

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


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device=_HOST, pin_memory=pin)
    host.copy_(t)
    return host


class TrainerOffload:
    """What :meth:`offload` moved away, so that :meth:`reload` puts back exactly that."""

    def __init__(self) -> None:
        on_gpu = torch.cuda.is_available()
        self.move_optimizer = on_gpu
        self.move_weights = on_gpu
        self.pin = on_gpu
        self.active = False
        self.auto_reloads = 0  # training calls that found the state offloaded (see with_training_state)
        self._model: Any = None
        self._optimizer_tensors: list[tuple[Any, Any, torch.device]] = []  # (owner, key or None, device)
        self._weight_buffers: list[tuple[Any, torch.Tensor, int]] = []  # (DDP buffer, host copy, bytes)
        self._weight_params: list[tuple[torch.nn.Parameter, torch.device]] = []

    def offload(self, model: Any, optimizer: Any, reference: Any = None) -> dict[str, int]:
        """Free ``model``'s grad buffers; move optimizer state and weights to the host when
        enabled. Returns the bytes freed or moved per kind (0 for a kind left in place)."""
        if self.active:
            return {"grad_buffers_freed": 0, "optimizer_to_host": 0, "weights_to_host": 0}
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.synchronize()  # the last step's kernels may still read these buffers
        stats = {"grad_buffers_freed": grad_buffer_bytes(model), "optimizer_to_host": 0, "weights_to_host": 0}
        # synchronize/empty_cache call torch.cuda, which a CPU-only torch rejects without the shim.
        model.offload_grad_buffers(synchronize=False, empty_cache=False)
        # Active from here: should a move below fail, reload still restores what was moved.
        self._model, self.active = model, True
        if self.move_optimizer:  # before the weights: aliasing is judged on live storages
            stats["optimizer_to_host"] = self._offload_optimizer(model, optimizer)
        if self.move_weights:
            stats["weights_to_host"] = self._offload_weights(model, reference)
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
        for buffer, host, nbytes in self._weight_buffers:
            buffer.param_data.untyped_storage().resize_(nbytes)
            buffer.param_data.copy_(host, non_blocking=self.pin)
            stats["weights"] += nbytes
        for param, device in self._weight_params:
            param.data = param.data.to(device, non_blocking=self.pin, copy=True)
            stats["weights"] += _nbytes(param.data)
        for owner, key, device in self._optimizer_tensors:
            if key is None:
                owner.data = owner.data.to(device, non_blocking=self.pin, copy=True)
                stats["optimizer"] += _nbytes(owner.data)
            else:
                owner[key] = owner[key].to(device, non_blocking=self.pin, copy=True)
                stats["optimizer"] += _nbytes(owner[key])
        self._model.restore_grad_buffers(synchronize=False)
        stats["grad_buffers"] = grad_buffer_bytes(self._model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # pinned copies are asynchronous
        self._weight_buffers, self._weight_params, self._optimizer_tensors = [], [], []
        self._model, self.active = None, False
        return stats

    def _offload_optimizer(self, model: Any, optimizer: Any) -> int:
        model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        moved = 0
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None or getattr(opt, "is_stub_optimizer", False):
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    # An fp32 model parameter (or a shard view of one) that the optimizer steps
                    # in place belongs to the model: moving it would detach it from the model.
                    if p.untyped_storage().data_ptr() in model_storages:
                        continue
                    self._optimizer_tensors.append((p, None, p.device))
                    moved += _nbytes(p.data)
                    p.data = _to_host(p.data, self.pin)
            for state in inner.state.values():
                for key, value in state.items():
                    # torch Adam's scalar step counter stays where Adam expects it.
                    if torch.is_tensor(value) and key != "step":
                        self._optimizer_tensors.append((state, key, value.device))
                        moved += _nbytes(value)
                        state[key] = _to_host(value, self.pin)
        return moved

    def _offload_weights(self, model: Any, reference: Any) -> int:
        moved = 0
        in_buffers: set[int] = set()
        for buffer in _ddp_buffers(model):
            if buffer.param_data is None:  # no distributed optimizer: parameters own their storage
                continue
            nbytes = _nbytes(buffer.param_data)
            self._weight_buffers.append((buffer, _to_host(buffer.param_data, self.pin), nbytes))
            in_buffers.add(buffer.param_data.untyped_storage().data_ptr())
            moved += nbytes
        params = [p for p in model.parameters() if p.untyped_storage().data_ptr() not in in_buffers]
        params += list(reference.parameters()) if reference is not None else []
        for buffer, _, _ in self._weight_buffers:
            buffer.param_data.untyped_storage().resize_(0)  # the parameters are views of it
        for param in params:
            self._weight_params.append((param, param.device))
            moved += _nbytes(param.data)
            param.data = _to_host(param.data, self.pin)
        return moved


def with_training_state(fn: _F) -> _F:
    """Decorator for the MegatronWorker methods that use weights, gradients or optimizer state:
    runs the call in ``cpu_device_mode`` (like ``with_cpu_device_mode``) after reloading what
    ``offload_for_rollout`` moved away, so a forgotten ``reload_for_training`` costs time (and a
    warning), never a wrong result."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with cpu_device_mode():
            if self._offload.active:
                log.warning("%s called while the trainer state is offloaded: reloading it first "
                            "(call reload_for_training before the logprob/training calls)", fn.__name__)
                self._offload.auto_reloads += 1
                self._offload.reload()
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]

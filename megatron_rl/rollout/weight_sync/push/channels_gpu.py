"""The GPU wires of the tensor weight push: CUDA IPC slots between a trainer rank and the engine
workers on its own GPU, NCCL groups for every other pair (``push.topology`` pairs them). Written
against vLLM's and PyTorch's documented APIs; the CPU wires in ``push.channels`` run the same
control flow in the test suite, the pairing rules run in ``tests/unit/test_gpu_rules_push.py``.

* IPC: the trainer rank allocates its ring's slots as one CUDA tensor and exports it once with
  ``torch.multiprocessing.reductions.reduce_tensor`` (what vLLM's ``ipc`` weight-transfer backend
  does per tensor); a worker rebuilds it with ``rebuild_cuda_tensor`` on its own device and copies
  its pieces from it. The handle carries the GPU's UUID and a worker opens it only when that is
  its own device's UUID, as vLLM's backend looks handles up by the worker's own GPU UUID
  (``vllm/distributed/weight_transfer/ipc_engine.py``, ``IPCWeightTransferEngine.receive_weights``);
  anything else is a pairing error, never a peer-access mapping of another GPU. The tickets stay
  in the host shared-memory header (``ShmRing`` with no data region).
* NCCL: vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (the rendezvous vLLM's ``nccl``
  backend uses, ``weight_transfer.nccl_common.stateless_init_process_group``), point-to-point
  ``send``/``recv`` of buckets on the current stream, in the plan's global order. A communicator
  never holds two processes of one GPU (NCCL refuses that: ncclInvalidUsage).
"""
from __future__ import annotations

import base64
import pickle

import torch

from megatron_rl.rollout.weight_sync.push.topology import check_own_gpu, device_uuid


def export_ipc_slots(num_slots: int, slot_bytes: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """``num_slots`` x ``slot_bytes`` bytes on ``device`` and their IPC handle (base64 pickle of
    ``reduce_tensor``'s rebuild arguments). Keep the tensor alive while engines use the handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    slots = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
    _, args = reduce_tensor(slots)
    uuid = device_uuid(slots.device)
    return slots, base64.b64encode(pickle.dumps((uuid, args))).decode()


def import_ipc_slots(handle: str, device: torch.device) -> torch.Tensor:
    """The trainer's slots (``export_ipc_slots``), rebuilt on ``device``, which must be the GPU
    they live on. The handle comes from our own trainer ranks through the driver (never from
    outside), so unpickling it is safe here."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = pickle.loads(base64.b64decode(handle))
    check_own_gpu(uuid, device_uuid(device))
    args = list(args)
    # Device indices differ between processes (each sees its own CUDA_VISIBLE_DEVICES): rebuild
    # on this worker's index of the GPU, as vLLM's IPC engine rewrites rebuild_cuda_tensor's arg 6.
    args[6] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


class NcclGroup:
    """Trainer ranks + engine workers in one NCCL communicator (vLLM's stateless rendezvous)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.rank, self.world_size = rank, world_size
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.comm = stateless_init_process_group(host, port, rank, world_size, index)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        stream = torch.cuda.current_stream(tensor.device)
        self.comm.send(tensor, dst, stream=stream)
        stream.synchronize()  # the sender reuses the slot for the next bucket

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        stream = torch.cuda.current_stream(tensor.device)
        self.comm.recv(tensor, src, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if callable(destroy):
            destroy()
        self.comm = None

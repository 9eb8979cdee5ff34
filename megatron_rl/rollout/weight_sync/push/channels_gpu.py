"""The GPU wires of the tensor weight push: CUDA IPC slots for engines on a trainer rank's node,
an NCCL group for engines on other nodes. Written against vLLM's and PyTorch's documented APIs;
NOT RUN on this project's CPU-only machines (the CPU wires in ``push.channels`` run the same
control flow in the test suite).

* IPC: the trainer rank allocates its ring's slots as one CUDA tensor and exports it once with
  ``torch.multiprocessing.reductions.reduce_tensor`` (what vLLM's ``ipc`` weight-transfer backend
  does per tensor); workers rebuild it with ``rebuild_cuda_tensor`` and copy their pieces from it.
  The tickets stay in the host shared-memory header (``ShmRing`` with no data region). Slots on
  another GPU of the node are read over NVLink/PCIe peer access when that GPU is visible to the
  worker (matched by UUID, as vLLM's backend matches handles); otherwise the open fails with a
  message pointing at ``rollout.weight_push_channel=network``.
* NCCL: vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (the rendezvous vLLM's ``nccl``
  backend uses, ``weight_transfer.nccl_common.stateless_init_process_group``), point-to-point
  ``send``/``recv`` of buckets on the current stream, in the plan's global order.
"""
from __future__ import annotations

import base64
import pickle

import torch


def export_ipc_slots(num_slots: int, slot_bytes: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """``num_slots`` x ``slot_bytes`` bytes on ``device`` and their IPC handle (base64 pickle of
    ``reduce_tensor``'s rebuild arguments). Keep the tensor alive while engines use the handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    slots = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
    _, args = reduce_tensor(slots)
    uuid = str(torch.cuda.get_device_properties(slots.device).uuid)
    return slots, base64.b64encode(pickle.dumps((uuid, args))).decode()


def import_ipc_slots(handle: str, device: torch.device) -> torch.Tensor:
    """The trainer's slots (``export_ipc_slots``) in this process. The handle comes from our own
    trainer ranks through the driver (never from outside), so unpickling it is safe here."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = pickle.loads(base64.b64decode(handle))
    # Device indices differ between processes (each sees its own CUDA_VISIBLE_DEVICES); the GPU's
    # UUID does not, which is how vLLM's IPC backend matches handles to devices too.
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    if uuid not in visible:
        raise RuntimeError(f"weight push: the trainer's slots are on GPU {uuid}, which this worker cannot see "
                           "(set rollout.weight_push_channel=network)")
    args = list(args)
    args[6] = visible[uuid]  # rebuild_cuda_tensor's device argument, as vLLM's IPC engine rewrites it
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

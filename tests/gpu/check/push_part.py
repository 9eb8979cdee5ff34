"""What the tensor weight push's pairing relies on, on the device (``megatron_rl.rollout.weight_sync
.push.topology``): GPU UUIDs name the physical GPU whatever a process's device numbering
(another process that sees the GPU only through ``CUDA_VISIBLE_DEVICES=<uuid>`` reports the same
UUID for its device 0), the pairing puts a trainer rank and a worker on that GPU on CUDA IPC,
the worker opens the trainer's IPC slots on its own device and reads the bytes intact, and a
handle of another GPU is refused before CUDA is asked to open it (as vLLM's IPC backend looks
handles up by the worker's own UUID: ``vllm/distributed/weight_transfer/ipc_engine.py``).

CPU mode: no UUIDs and no CUDA IPC; the pairing by node and the refusal of a handle of another
GPU (pure logic) run, the device parts are reported as not applicable.
"""
from __future__ import annotations

import base64
import os
import pickle
from typing import Any

import torch

from tests.gpu.check.common import Context, outcome, prepare_process, stop_child

_MIB = 8


def _refuses_other_gpu(handle_uuid: str, own: str) -> bool:
    from megatron_rl.rollout.weight_sync.push.topology import check_own_gpu

    try:
        check_own_gpu(handle_uuid, own)
    except RuntimeError as exc:
        return "CUDA IPC pairs only processes of one GPU" in str(exc)
    return False


def _worker(conn: Any, handle: str) -> None:
    """The engine worker's side, in a process that sees the GPU as device 0 only."""
    from megatron_rl.rollout.weight_sync.push.channels_gpu import import_ipc_slots
    from megatron_rl.rollout.weight_sync.push.topology import device_uuid

    torch.cuda.set_device(0)
    out: dict[str, Any] = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "count": torch.cuda.device_count(),
                           "uuid": device_uuid(torch.device("cuda", 0))}
    slots = import_ipc_slots(handle, torch.device("cuda", 0))
    out["checksum"] = int(slots.view(torch.int16).sum(dtype=torch.int64))
    del slots
    _, args = pickle.loads(base64.b64decode(handle))
    other = base64.b64encode(pickle.dumps(("GPU-00000000-0000-0000-0000-000000000000", args))).decode()
    try:
        import_ipc_slots(other, torch.device("cuda", 0))
        out["other_refused"] = False
    except RuntimeError as exc:
        out["other_refused"] = "CUDA IPC pairs only processes of one GPU" in str(exc)
    conn.send(out)
    conn.recv()  # the trainer side keeps its slots alive until this process is done with them


def push_pairing(ctx: Context) -> dict[str, Any]:
    """GPU UUIDs and their ordering, the pairing on them, CUDA IPC slots opened on their own GPU
    only (see the module docstring)."""
    prepare_process(ctx, deterministic=False)
    from megatron_rl.rollout.weight_sync.push.topology import LOCAL, NET, Place, device_uuid, pair

    if not ctx.gpu:
        wires, groups = pair([Place("n0"), Place("n1")], [[Place("n0")], [Place("n1")]], "cpu")
        checks = {"cpu: no GPU UUID": device_uuid(torch.device("cpu")) == "",
                  "cpu: pairing by node": wires == [[LOCAL, NET], [NET, LOCAL]] and groups == [],
                  "a handle of another GPU is refused": _refuses_other_gpu("GPU-a", "GPU-b"),
                  "a handle without a GPU is refused": _refuses_other_gpu("", "")}
        return outcome(checks, "cpu: pairing by node; other-GPU handles refused (no CUDA IPC on CPU)",
                       {"mechanism": "cpu shared memory"})

    import torch.multiprocessing as mp

    from megatron_rl.rollout.weight_sync.push.channels_gpu import export_ipc_slots

    count = torch.cuda.device_count()
    uuids = [device_uuid(torch.device("cuda", i)) for i in range(count)]
    props = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    here = uuids[torch.cuda.current_device()]
    # The pairing on the real UUID: a trainer rank and a worker on this GPU are IPC, one on another NCCL.
    wires, groups = pair([Place("n0", here)], [[Place("n0", here)], [Place("n0", "GPU-elsewhere")]], "cuda")
    slots, handle = export_ipc_slots(2, _MIB << 20, torch.device("cuda", torch.cuda.current_device()))
    slots.view(torch.bfloat16).normal_()
    torch.cuda.synchronize()
    expected = int(slots.view(torch.int16).sum(dtype=torch.int64))
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    # The worker numbers this GPU 0, whatever it is here; CUDA takes a UUID there with its "GPU-" prefix.
    os.environ["CUDA_VISIBLE_DEVICES"] = here if here.startswith("GPU-") else f"GPU-{here}"
    try:
        proc = spawn.Process(target=_worker, args=(child, handle), daemon=True)
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        if not parent.poll(120):
            raise TimeoutError("the worker process did not answer within 120 s")
        seen = parent.recv()
        parent.send("done")
    finally:
        stop_child(proc)
    checks = {"every device has a distinct UUID": len(set(uuids)) == count and all(uuids),
              "device_uuid is torch's UUID of the device": uuids == props,
              "the worker sees the GPU as device 0 by UUID": seen["count"] == 1 and seen["uuid"] == here,
              "same GPU is IPC, another is NCCL": wires == [[LOCAL, NET]] and groups == [[0, 2]],
              "IPC slots opened on their own GPU, intact": seen["checksum"] == expected,
              "a handle of another GPU is refused": bool(seen["other_refused"]),
              "worker exited cleanly": proc.exitcode == 0}
    figures = {"devices": count, "uuids": uuids, "worker": seen, "slot_bytes": _MIB << 20, "mechanism": "cuda ipc"}
    summary = (f"{count} device(s), UUID {here}; worker (CUDA_VISIBLE_DEVICES=<uuid>) saw {seen['uuid']}; "
               f"IPC slots {'intact' if seen['checksum'] == expected else 'CORRUPTED'}; other-GPU handle "
               f"{'refused' if seen['other_refused'] else 'OPENED'}")
    return outcome(checks, summary, figures)

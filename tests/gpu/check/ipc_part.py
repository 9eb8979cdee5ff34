"""A bucket of weights handed from one process to another on the same device, the mechanism of
vLLM's ``ipc`` weight-transfer backend: the sender packs tensors into one flat buffer and sends
``torch.multiprocessing.reductions.reduce_tensor(buffer)`` (a CUDA IPC memory handle on a GPU;
a shared-memory file descriptor on CPU); the receiver rebuilds a tensor over the sender's memory
and copies each named tensor out of it into its own parameters. Timed against a plain
device-to-device copy of the same bytes inside the receiver.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from tests.gpu.check.common import Context, outcome, prepare_process, stop_child


def _bucket_layout(mib: int) -> list[tuple[str, tuple[int, ...]]]:
    """Named weight shapes (a Qwen2.5-0.5B decoder layer's, repeated) filling about ``mib`` MiB of bf16."""
    layer = [("qkv.weight", (1152, 896)), ("qkv.bias", (1152,)), ("proj.weight", (896, 896)),
             ("fc1.weight", (9728, 896)), ("fc2.weight", (896, 4864)), ("norm1.weight", (896,)),
             ("norm2.weight", (896,))]
    per_layer = sum(torch.Size(shape).numel() for _, shape in layer) * 2
    if mib * 2 ** 20 < per_layer:  # CPU mode: a smaller layer of the same make-up
        layer = [("qkv.weight", (192, 128)), ("qkv.bias", (192,)), ("proj.weight", (128, 128)),
                 ("fc1.weight", (512, 128)), ("fc2.weight", (128, 256)), ("norm1.weight", (128,)),
                 ("norm2.weight", (128,))]
        per_layer = sum(torch.Size(shape).numel() for _, shape in layer) * 2
    count = max(1, mib * 2 ** 20 // per_layer)
    return [(f"layers.{i}.{name}", shape) for i in range(count) for name, shape in layer]


def _checksum(t: torch.Tensor) -> int:
    """Order-independent, exact: the int16 bit patterns summed in int64."""
    return int(t.view(torch.int16).sum(dtype=torch.int64))


def _receiver(conn: Any, mode: str, layout: list, rounds: int) -> None:
    """The other process: rebuild each bucket from its handle, copy every tensor into its own
    parameters, report checksums and times; then time a device-to-device copy of the same size."""
    ctx_device = torch.device("cuda", 0) if mode == "gpu" else torch.device("cpu")
    if mode == "gpu":
        torch.cuda.set_device(0)
    params = {name: torch.empty(shape, dtype=torch.bfloat16, device=ctx_device) for name, shape in layout}

    def sync() -> None:
        if mode == "gpu":
            torch.cuda.synchronize()

    conn.send("ready")
    for _ in range(rounds):
        rebuild, args = conn.recv()
        start = time.perf_counter()
        flat = rebuild(*args)
        opened = time.perf_counter()
        offset = 0
        for name, shape in layout:
            n = torch.Size(shape).numel()
            params[name].copy_(flat[offset:offset + n].view(shape))
            offset += n
        sync()
        done = time.perf_counter()
        del flat
        checksum = sum(_checksum(p) for p in params.values())
        conn.send({"open_s": opened - start, "copy_s": done - opened, "checksum": checksum})
    nbytes = sum(p.numel() for p in params.values()) * 2
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=ctx_device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    conn.send({"copy_times": times})
    conn.recv()  # keep the process (and its handles) alive until the sender is done


def cuda_ipc(ctx: Context) -> dict[str, Any]:
    """Hands ``ipc_rounds`` buckets of ``ipc_mib`` MiB to a spawned process; every bucket arrives
    intact (checksums equal), and reports GB/s of the hand-over (handle, rebuild, copy into the
    receiver's parameters) against a device-to-device copy."""
    prepare_process(ctx, deterministic=False)
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    s = ctx.sizes
    layout = _bucket_layout(s.ipc_mib)
    numel = sum(torch.Size(shape).numel() for _, shape in layout)
    nbytes = numel * 2
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_receiver, args=(child, ctx.mode, layout, s.ipc_rounds), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise TimeoutError("the receiver process did not start within 120 s")
        assert parent.recv() == "ready"
        bucket = torch.empty(numel, dtype=torch.bfloat16, device=ctx.device)
        if not ctx.gpu:
            bucket.share_memory_()  # what a CUDA allocation is for IPC: memory another process can map
        rounds = []
        for r in range(s.ipc_rounds):
            bucket.normal_(generator=None)
            bucket.add_(r)  # a different bucket each round
            expected = _checksum(bucket)
            if ctx.gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            parent.send(reduce_tensor(bucket))
            reply = parent.recv()
            reply["total_s"] = time.perf_counter() - start
            reply["intact"] = reply["checksum"] == expected
            rounds.append(reply)
        copy = parent.recv()["copy_times"]
        parent.send("done")
    finally:
        stop_child(proc)
    steady = rounds[1:] or rounds
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    handover = sorted(gbps(r["total_s"]) for r in steady)[len(steady) // 2]
    copy_gbps = gbps(sorted(copy)[len(copy) // 2])
    figures = {"bucket_bytes": nbytes, "tensors": len(layout), "rounds": rounds,
               "first_round_gb_per_s": gbps(rounds[0]["total_s"]), "handover_gb_per_s_median": handover,
               "device_copy_gb_per_s_median": copy_gbps, "mechanism": "cuda ipc" if ctx.gpu else "cpu shared memory",
               "receiver_exit": proc.exitcode}
    intact = all(r["intact"] for r in rounds)
    checks = {"every bucket intact": intact, "receiver exited cleanly": proc.exitcode == 0}
    summary = (f"{figures['mechanism']}: {nbytes / 2 ** 20:.0f} MiB, {len(layout)} tensors, {s.ipc_rounds} rounds "
               f"{'intact' if intact else 'CORRUPTED'}; hand-over {handover:.1f} GB/s (first "
               f"{figures['first_round_gb_per_s']:.1f}) vs device copy {copy_gbps:.1f} GB/s (bytes once)")
    return outcome(checks, summary, figures)

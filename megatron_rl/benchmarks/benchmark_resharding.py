"""Benchmark: planned resharding (Megatron TP_t x PP_t -> vLLM TP_r) vs gather-then-scatter, and
vs a plain tensor copy of the same bytes, in one run.

    python -m megatron_rl.benchmarks.benchmark_resharding [--world 4] [--tp-t 2] [--pp-t 2] [--tp-r 4]
        [--placement colocated|disjoint] [--hidden 1024] [--layers 4] [--vocab 32000]
        [--bucket-mb 32] [--repeats 3]

Three ways of getting the same destination shards, on ``--world`` gloo processes
(``disjoint``: trainer on the first half, engines on the second half):

* planned: ``megatron_rl.resharding`` (each destination byte sent once, point-to-point,
  size-bounded buckets, local copies where source and destination share a process);
* gather-then-scatter (what a naive weight sync does): every trainer shard is sent to rank 0,
  rank 0 builds every engine shard, then sends each to its owner;
* plain copy: one ``Tensor.copy_`` of as many bytes as the destination shards hold, in one
  process: the memory-bandwidth bound for touching those bytes once.

Weights are synthetic (a random Qwen2-shaped model; each rank only generates what it holds).
Both distributed methods are checked to produce identical shards. Prints one table with time,
bytes crossing processes, peak extra memory on the busiest rank, throughput and ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from collections.abc import Mapping

import torch

from megatron_rl.model.hf_weights import hf_to_megatron_shard
from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.resharding.execute import allocate_destinations, execute_plan
from megatron_rl.resharding.layouts import MegatronLayout, VLLMLayout, logical_shapes
from megatron_rl.resharding.plan import build_plan
from megatron_rl.resharding.transport import TorchDistributedTransport
from megatron_rl.tools.spawn_ranks import run_ranks

MB = 1 << 20


class SyntheticHF(Mapping):
    """HF-named random tensors generated on access (seeded by name), so a rank only ever
    materialises the tensors its own shards need."""

    def __init__(self, arch: Qwen2Arch) -> None:
        self.shapes = logical_shapes(arch)

    def __getitem__(self, name: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(self.shapes[name], generator=g)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _layouts(args) -> tuple[Qwen2Arch, MegatronLayout, VLLMLayout, list[int], list[int]]:
    arch = Qwen2Arch(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                     num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=4,
                     max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    half = args.world // 2 if args.placement == "disjoint" else args.world
    src_procs = list(range(half))
    dst_procs = list(range(args.world - half, args.world))
    src = MegatronLayout(arch, args.tp_t, args.pp_t, half // (args.tp_t * args.pp_t))
    dst = VLLMLayout(arch, args.tp_r, half // args.tp_r)
    return arch, src, dst, src_procs, dst_procs


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in sorted(tensors)])


def _unflat(flat: torch.Tensor, specs) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for spec in sorted(specs, key=lambda s: s.name):
        n = torch.Size(spec.shape).numel()
        out[spec.name] = flat[at:at + n].view(spec.shape)
        at += n
    return out


def _gather_then_scatter(rank, src, dst, src_procs, dst_procs, sources) -> tuple[dict, int, int]:
    """Naive sync: all source shards to rank 0, rank 0 cuts every destination shard, sends them."""
    dist = torch.distributed
    sent = peak = 0
    if rank == 0:
        gathered = dict(sources)
        for shard, proc in enumerate(src_procs):
            if proc != 0:
                specs = src.tensors(shard)
                buf = torch.empty(sum(torch.Size(s.shape).numel() for s in specs))
                dist.recv(buf, proc)
                gathered[shard] = _unflat(buf, specs)
                sent += buf.numel() * 4
        local_plan = build_plan(src, dst, [0] * src.num_shards, [0] * dst.num_shards)
        everything = allocate_destinations(local_plan, 0, torch.float32)
        execute_plan(local_plan, gathered, everything, None, proc=0)
        peak = sum(t.numel() * 4 for s in gathered.values() for t in s.values())
        peak += sum(t.numel() * 4 for s in everything.values() for t in s.values())
        for shard, proc in enumerate(dst_procs):
            if proc != 0:
                flat = _flat(everything[shard])
                dist.send(flat, proc)
                sent += flat.numel() * 4
        mine = {s: t for s, t in everything.items() if dst_procs[s] == 0}
    else:
        for shard, proc in enumerate(src_procs):
            if proc == rank:
                dist.send(_flat(sources[shard]), 0)
        mine = {}
        for shard, proc in enumerate(dst_procs):
            if proc == rank:
                specs = dst.tensors(shard)
                buf = torch.empty(sum(torch.Size(s.shape).numel() for s in specs))
                dist.recv(buf, 0)
                mine[shard] = _unflat(buf, specs)
    return mine, sent, peak


def _rank_main(rank: int, args, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    arch, src, dst, src_procs, dst_procs = _layouts(args)
    hf = SyntheticHF(arch)
    sources = {}
    for shard, proc in enumerate(src_procs):
        if proc == rank:
            tp_rank, pp_rank, _ = src.coords(shard)
            sources[shard] = hf_to_megatron_shard(hf, arch, tp_rank, src.tp, pp_rank, src.pp)
    plan = build_plan(src, dst, src_procs, dst_procs, bucket_bytes=args.bucket_mb * MB)
    transport = TorchDistributedTransport()
    planned_t, naive_t = [], []
    for _ in range(args.repeats):
        dests = allocate_destinations(plan, rank, torch.float32)
        dist.barrier()
        start = time.perf_counter()
        execute_plan(plan, sources, dests, transport, dtype=torch.float32)
        dist.barrier()
        planned_t.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        naive, naive_sent, naive_peak = _gather_then_scatter(rank, src, dst, src_procs, dst_procs, sources)
        dist.barrier()
        naive_t.append(time.perf_counter() - start)
    same = all(torch.equal(dests[s][k], naive[s][k]) for s in dests for k in dests[s])
    flags = torch.tensor([int(same)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        largest = max((b.numel for r in plan.rounds for b in r), default=0) * 4
        queue.put({"planned_s": min(planned_t), "naive_s": min(naive_t), "planned_sent": plan.sent_numel * 4,
                   "planned_local": plan.local_numel * 4, "dst_bytes": plan.dst_numel * 4,
                   "planned_peak": 2 * largest, "naive_sent": naive_sent, "naive_peak": naive_peak,
                   "rounds": len(plan.rounds), "identical": bool(flags.item()), "src": repr(src), "dst": repr(dst)})
    dist.destroy_process_group()


def _plain_copy_seconds(nbytes: int, repeats: int) -> float:
    torch.set_num_threads(1)
    a = torch.randn(nbytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="gloo processes")
    parser.add_argument("--tp-t", type=int, default=2, help="trainer tensor-parallel size")
    parser.add_argument("--pp-t", type=int, default=2, help="trainer pipeline-parallel size")
    parser.add_argument("--tp-r", type=int, default=4, help="rollout (vLLM) tensor-parallel size")
    parser.add_argument("--placement", choices=("colocated", "disjoint"), default="colocated")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="best of N")
    args = parser.parse_args(argv)
    _layouts(args)  # validate before spawning
    res = run_ranks(_rank_main, args.world, args, timeout_s=1800, join_s=60)
    copy_s = _plain_copy_seconds(res["dst_bytes"], args.repeats)
    print(f"{res['src']} -> {res['dst']}, {args.placement} on {args.world} gloo processes; "
          f"destination shards {res['dst_bytes'] / MB:.1f} MB; bucket {args.bucket_mb} MB; best of {args.repeats}")
    print(f"outputs identical (planned vs gather-then-scatter): {res['identical']}; planned rounds: {res['rounds']}")
    rows = [
        ("planned p2p buckets", res["planned_s"], res["planned_sent"], res["planned_peak"]),
        ("gather -> rank 0 -> scatter", res["naive_s"], res["naive_sent"], res["naive_peak"]),
        ("plain tensor copy (bound)", copy_s, 0, res["dst_bytes"]),
    ]
    print(f"{'method':30s} {'time s':>9s} {'GB/s':>7s} {'sent MB':>9s} {'peak extra MB':>14s} {'time / planned':>15s}")
    for name, secs, sent, peak in rows:
        print(f"{name:30s} {secs:9.3f} {res['dst_bytes'] / secs / 1e9:7.2f} {sent / MB:9.1f} {peak / MB:14.1f} "
              f"{secs / res['planned_s']:15.2f}")
    print(f"speed-up of planned over gather-then-scatter: {res['naive_s'] / res['planned_s']:.2f}x; "
          f"bytes sent: {res['planned_sent'] / max(1, res['naive_sent']):.2f}x of the baseline; "
          f"planned is {res['planned_s'] / copy_s:.1f}x the memory-copy bound")
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

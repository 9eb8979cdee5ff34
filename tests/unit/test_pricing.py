"""rollpacker.pricing on synthetic traces written here: the CPU fit recovers the constants the
traces were made with, pricing sums as docs/pricing.md states, the packing limit on cases
checked by hand, and bad input fails naming file:line and the key."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_rl.planning.architectures import BUILTIN_SHAPES
from megatron_rl.planning.memory import GPUS
from rollpacker.pricing import CpuModel, TraceError, fit_cpu_model, gpu_model, packing_limit, price_run, read_trace
from rollpacker.pricing.cli import main
from rollpacker.pricing.packing import Speculation, fewest_iterations, lpt_iterations
from rollpacker.simulator.costs import TrainModel
from rollpacker.simulator.engine_model import EngineModel
from tests.helpers.pricing_runs import TRUE, write_run


def test_fit_recovers_the_constants_the_traces_were_made_with(tmp_path):
    runs = [read_trace(write_run(tmp_path / f"r{i}", TRUE, seed=i)) for i in range(2)]
    fit = fit_cpu_model(runs)
    for key in ("fixed_s", "decode_token_s", "context_token_s", "prefill_token_s", "round_s",
                "train_fixed_s", "train_token_s", "step_other_s"):
        assert getattr(fit, key) == pytest.approx(getattr(TRUE, key), rel=1e-6, abs=1e-9), key


def test_fit_drops_the_gaps_in_which_an_engine_waited_for_work(tmp_path):
    # Two waves of 8 requests on each engine of 4 slots: prefills inside a wave, after a busy row.
    runs = [read_trace(write_run(tmp_path / f"r{i}", TRUE, seed=i, idle_s=0.5, samples=32)) for i in range(2)]
    fit = fit_cpu_model(runs)
    for key in ("fixed_s", "decode_token_s", "context_token_s", "prefill_token_s"):
        assert getattr(fit, key) == pytest.approx(getattr(TRUE, key), rel=1e-6, abs=1e-9), key
    # The waits are rollout time all the same: the fitted per-round part holds them.
    assert fit.round_s == pytest.approx(TRUE.round_s + 0.5, rel=1e-6)


def test_a_coefficient_fitted_negative_is_dropped_and_the_rest_refitted():
    from rollpacker.simulator.fitting import nnls

    rng = random.Random(0)
    # y falls with the third feature: its unconstrained coefficient is negative.
    rows = [[1.0, rng.uniform(0, 10), rng.uniform(0, 10)] for _ in range(50)]
    y = [2.0 + 0.5 * r[1] - 0.3 * r[2] + rng.uniform(-0.1, 0.1) for r in rows]
    coef = nnls(rows, y)
    assert coef[2] == 0.0 and min(coef) >= 0
    # Refitted without it, the predictions still sum to the measured total (clipping would not).
    assert sum(sum(c * x for c, x in zip(coef, r)) for r in rows) == pytest.approx(sum(y), rel=1e-9)


def test_cpu_model_predicts_an_unfitted_run_within_its_noise(tmp_path):
    fit = fit_cpu_model([read_trace(write_run(tmp_path / f"r{i}", TRUE, seed=i, noise=0.2)) for i in range(2)])
    held_out = price_run(write_run(tmp_path / "held", TRUE, seed=7, noise=0.2), fit)
    ratio = held_out.total("rollout_s") / held_out.total("measured_rollout_s")
    assert ratio == pytest.approx(1.0, abs=0.05)
    # A model with the per-decode-token cost doubled misses it: the check can fail.
    wrong = CpuModel(**{**fit.__dict__, "decode_token_s": 2 * fit.decode_token_s + 1e-3})
    bad = price_run(tmp_path / "held", wrong)
    assert bad.total("rollout_s") / bad.total("measured_rollout_s") > 1.1


def test_pricing_sums_as_documented(tmp_path):
    d = write_run(tmp_path / "r", TRUE, seed=3, steps=2)
    run = read_trace(d)
    price = price_run(d, TRUE)
    for s in price.steps:
        per_engine = [sum(TRUE.cost(1, 4, dc, c, p) for dc, c, p in zip(b.rows["decode_tokens"], b.rows["context_tokens"],
                                                                       b.rows["prefill_tokens"]))
                      for b in run.blocks_of(s.step)]
        assert s.rollout_s == pytest.approx(TRUE.round_s + max(per_engine))
        assert s.rollout_s == pytest.approx(s.measured_rollout_s)  # made with these constants
        assert s.step_s == pytest.approx(s.rollout_s + s.train_s + TRUE.step_other_s)
        assert s.step_s == pytest.approx(s.measured_step_s)
        assert s.iterations == max(b.iterations for b in run.blocks_of(s.step))
    assert price.total("step_s") == pytest.approx(sum(s.step_s for s in price.steps))


def test_gpu_models_price_iterations_with_the_simulators_engine_and_train_models(tmp_path):
    d = write_run(tmp_path / "r", TRUE, seed=4, steps=1)
    run = read_trace(d)
    h800 = gpu_model(run, "h800", as_model="qwen2.5-7b")
    shape, gpu = BUILTIN_SHAPES["qwen2.5-7b"], GPUS["h800"]
    e = EngineModel.for_gpu(shape, gpu, 1, h800.cfg.rollout.gpu_memory_utilization, 4)
    b = run.blocks[0]
    want = [e.step_s + e.per_seq_s * dc + e.per_ctx_token_s * c + e.prefill_token_s * p
            for dc, c, p in zip(b.rows["decode_tokens"], b.rows["context_tokens"], b.rows["prefill_tokens"])]
    assert h800.iteration_s(b) == pytest.approx(want)
    batch = run.batches[1]
    tm = TrainModel.from_recipe(h800.cfg, shape, gpu, mfu=0.4)
    seqs = [p + r for p, r in zip(batch.prompt_tokens, batch.response_tokens)]
    assert h800.train_s(run, 1) == pytest.approx(tm.time(seqs) + tm.sync_s)
    # H200's 4.8 TB/s against H800's 3.35 TB/s: a memory-bound decode schedule is cheaper.
    p800, p200 = price_run(d, "h800", as_model="qwen2.5-7b"), price_run(d, "h200", as_model="qwen2.5-7b")
    assert p200.total("rollout_s") < p800.total("rollout_s")
    # The 32B shape costs more per iteration than the 7B one.
    assert price_run(d, "h800", as_model="qwen2.5-32b").total("rollout_s") > p800.total("rollout_s")
    # Measured constants replace the datasheet ones.
    consts = tmp_path / "consts.json"
    consts.write_text(json.dumps({"step_s": 1.0, "per_seq_s": 0.0, "per_ctx_token_s": 0.0, "prefill_token_s": 0.0,
                                  "kv_capacity_tokens": 1000, "max_num_seqs": 4}))
    measured = price_run(d, "h800", as_model="qwen2.5-7b", engine_constants=consts)
    assert measured.steps[0].rollout_s == pytest.approx(max(b.iterations for b in run.blocks))


def test_packing_limit_by_hand():
    # 10, 10, 10, 1 on 2 slots: 31 tokens need ceil(31 / 2) = 16 iterations, longest-remaining
    # first reaches it; pinned to slots, longest first, two of the 10s share one: 20.
    assert fewest_iterations([10, 10, 10, 1], 2) == 16
    assert lpt_iterations([10, 10, 10, 1], 2) == 20
    assert fewest_iterations([10, 10, 10, 1], 8) == 10  # the longest response bounds it
    assert lpt_iterations([3, 3, 2, 2, 2], 2) == 7
    # Two tokens per iteration (speculation): 5, 5, 5, 1 iterations.
    assert fewest_iterations([10, 10, 10, 1], 2, Speculation(2.0, 1.0)) == 8
    # Priced time: cost = 1 + 0.1 * decode + 0.01 * context + 0.001 * prefill, 2 engines x 1 slot.
    lim = packing_limit([2, 2, 2, 2], [10, 10, 10, 1], engines=2, max_num_seqs=1,
                        cost=lambda d, c, p: 1 + 0.1 * d + 0.01 * c + 0.001 * p, round_fixed_s=0.5,
                        actual_iterations=32, actual_time_s=40.0)
    context = 3 * (10 * 2 + 45) + (1 * 2 + 0)  # each response: L * prompt + 0 + 1 + ... + (L - 1)
    assert lim.iterations == 16
    assert lim.time_s == pytest.approx(0.5 + 16 * 1 + (0.1 * 31 + 0.01 * context + 0.001 * 8) / 2)
    assert lim.iteration_fraction == pytest.approx(0.5) and lim.time_fraction == pytest.approx(lim.time_s / 40.0)


def test_packing_limit_of_a_priced_run_is_below_the_actual_schedule(tmp_path):
    price = price_run(write_run(tmp_path / "r", TRUE, seed=5, steps=3), "h800", as_model="qwen2.5-7b")
    for s in price.steps:
        p = s.packing
        assert p.iterations <= p.lpt_iterations and p.time_s <= s.rollout_s, s
        assert 0 < p.iteration_fraction and 0 < p.time_fraction
    assert 0 < price.packing_time_fraction


def test_a_step_without_a_batch_line_takes_its_lengths_from_trained_prompts(tmp_path):
    d = write_run(tmp_path / "r", TRUE, seed=8, steps=2)
    path = d / "engine_trace.jsonl"
    lines = _lines(path)
    batch = next(x for x in lines if x["kind"] == "batch" and x["step"] == 2)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines if x is not batch))
    assert 2 not in read_trace(d).batches
    pairs = [[p, r] for p, r in zip(batch["prompt_tokens"], batch["response_tokens"])]
    (d / "trained_prompts.jsonl").write_text(json.dumps({"step": 2, "prompt_ids": [], "lengths": pairs}) + "\n")
    got = read_trace(d).batches[2]
    assert (got.prompt_tokens, got.response_tokens, got.round) == (batch["prompt_tokens"], batch["response_tokens"],
                                                                    "baseline")
    (d / "trained_prompts.jsonl").write_text(json.dumps({"step": 2, "lengths": [[3, 4, 5]]}) + "\n")
    with pytest.raises(TraceError, match=r"trained_prompts.jsonl:1: key 'lengths' must hold"):
        read_trace(d)


def test_speculation_is_measured_from_the_rows(tmp_path):
    # Every decoding sequence proposed 2 drafts and got 1 accepted: 2 tokens per iteration.
    price = price_run(write_run(tmp_path / "r", TRUE, seed=6, steps=1, drafts=2, accepted=1), TRUE)
    assert price.steps[0].packing.tokens_per_iteration == pytest.approx(2.0)
    plain = price_run(write_run(tmp_path / "p", TRUE, seed=6, steps=1), TRUE)
    assert plain.steps[0].packing.tokens_per_iteration == 1.0
    assert price.steps[0].packing.iterations < plain.steps[0].packing.iterations


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("edit, message", [
    (lambda L: L[0].pop("max_num_seqs"), ":1: missing key 'max_num_seqs'"),
    (lambda L: L[1]["rows"][3].pop(), ":2: key 'rows'[3] must be a list of 11 values"),
    (lambda L: L[0]["rows"][0].__setitem__(5, "x"), ":1: key 'rows'[0] column 'decode_tokens' must be a number"),
    (lambda L: L[2]["response_tokens"].append(3), ":3: key 'response_tokens' has 17 entries, 'prompt_tokens' 16"),
    (lambda L: L[2].__setitem__("kind", "engines"), ":3: key 'kind' must be 'engine' or 'batch'"),
    (lambda L: L[0]["columns"].remove("context_tokens"), ":1: key 'columns' lacks ['context_tokens']"),
])
def test_bad_trace_lines_name_file_line_and_key(tmp_path, edit, message):
    d = write_run(tmp_path / "r", TRUE, seed=1, steps=1)
    path = d / "engine_trace.jsonl"
    lines = _lines(path)
    edit(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(TraceError) as exc:
        read_trace(d)
    assert f"{path}{message}" in str(exc.value)


def test_missing_trace_file_and_cli_errors(tmp_path, capsys):
    d = write_run(tmp_path / "r", TRUE, seed=2, steps=1)
    (d / "engine_trace.jsonl").unlink()
    assert main([str(d), "--gpu", "h800", "--as-model", "qwen2.5-7b"]) == 2
    assert f"{d / 'engine_trace.jsonl'}: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fixed_s": 1.0}))
    d2 = write_run(tmp_path / "r2", TRUE, seed=2, steps=1)
    assert main([str(d2), "--cpu-constants", str(bad)]) == 2
    assert "missing keys ['context_token_s'" in capsys.readouterr().err


def test_cli_fits_prices_and_writes_json(tmp_path, capsys):
    dirs = [str(write_run(tmp_path / f"r{i}", TRUE, seed=i, steps=3)) for i in range(2)]
    fit, out = tmp_path / "cpu.json", tmp_path / "priced.json"
    assert main([*dirs, "--fit-cpu", str(fit), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "meas.roll" in text and "packing limit:" in text
    assert CpuModel.from_json(fit).decode_token_s == pytest.approx(TRUE.decode_token_s, rel=1e-6)
    data = json.loads(out.read_text())
    assert data["gpu"] == "cpu" and len(data["runs"]) == 2 and len(data["runs"][0]["steps"]) == 3
    s = data["runs"][0]["summary"]
    assert s["rollout_s"] == pytest.approx(s["measured_rollout_s"])
    assert main([dirs[0], "--gpu", "h800", "--as-model", "qwen2.5-7b"]) == 0
    assert "H800-80GB pricing Qwen2.5-7B" in capsys.readouterr().out

"""Streamed gradient accumulation (RollPacker's stream trainer) equals the ordinary update.

For each case a set of spawned ranks (2, then 4) builds the worker, takes an ordinary
``train_step`` on a batch, reloads the same initial weights and a fresh optimizer (``load_hf``
again), feeds the same samples through ``accumulate_gradients`` in uneven chunks (one sample,
which leaves a DP rank without work under DP2; an empty chunk; then the rest in two pieces, with
a ``compute_logprobs`` call in between as the stream trainer makes) and takes the step with
``apply_accumulated_gradients`` and the batch totals. Layouts TP2, PP2 (tied embeddings split
over the stages, so the embedding-grad sync is exercised), DP2, TP2xDP2 and PP2xDP2; all three
``loss_agg`` modes, a KL term against the reference model, TIS weights; fp32.

How the step is compared (fp32; strict, yet meaningful under Adam):

* gradient (``export_hf_grads``, grad_clip 0: what the optimizer used), over the whole model:
  ``||g_stream - g_ref|| <= 1e-6 * ||g_ref||`` (measured ~5e-7), and per tensor
  ``max|g_stream - g_ref| <= 5e-6 * max|g_ref|`` (measured <= 1.2e-6). Both sides are the same
  sum in a different fp32 order (1/N applied at each loss vs. once at the end, other microbatch
  packing); two ordinary train_steps that differ only in micro_batch_tokens already differ by
  ~7e-7 of the max on this model, so an element-wise 1e-6 would test rounding luck.
* parameters after the step, element-wise per tensor:
  ``|p_stream - p_ref| <= 1e-6 * max|p_ref| + lr * 5e-6 * max|g_ref| * s``, where ``s`` is the
  steepest slope of Adam's first step ``g / (|g| + eps)`` within the gradient tolerance of
  ``g_ref`` (``eps / (|g_ref| - tol + eps)^2``, ``1 / eps`` where the sign may flip). The first
  step is ~``lr * sign(g)``, blind to rounding wherever |g| >> eps; there the second term is
  negligible and the check is the plain 1e-6 one. Only where |g| is within the tolerance of 0
  (or near eps = 1e-8) does the slope ~1/eps turn a 1e-12 rounding difference of g into a
  visible parameter difference, and the second term admits exactly that. It is computed from
  the reference run and the tolerances only, so a wrong gradient cannot widen it, and at least
  98% of the model's elements must be in the plain regime (measured 99.2-99.7%), so the check
  cannot quietly degenerate.

Wrong implementations fail (tried once each): normalising each chunk by its own totals gives
gradients off by ~4x in every case; finalising the grads per chunk re-sums the tied embedding
(PP2: gradient off by ~0.7 relative) and, under DP, runs the DP all-reduce on the ranks that had
samples only, which hangs the group until run_spmd's timeout.

Streaming on the GPUs the rollout freed (RollPacker's handoff): one DP replica of two is freed and
streams every chunk alone (``accumulate_gradients(own=True)`` and ``compute_logprobs(own=True)`` on its
ranks only, the chunk split by ``rank_batches.replica_shares`` as ``PolicyGroup`` splits it); after the
round both replicas take the rest, split to even their tokens; one ``apply_accumulated_gradients`` on every
rank. DP2, TP2xDP2 and PP2xDP2, every loss aggregation, KL and TIS, the same tolerances against the
ordinary step; each rank counts the forward passes it ran while streaming: the other replica's ranks ran
none.

The last tests check the driver handle's asyncio plumbing (PolicyGroup) with fake actors: a call on some
replicas reaches their ranks only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest
import torch

from tests.helpers.megatron_cases import make_samples, policy_loss_cfg, run_spmd

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

NUM_SAMPLES = 14
CHUNKS = [(0, 1), (1, 1), (1, 6), (6, NUM_SAMPLES)]  # one sample, empty, five, the rest
LOGPROB_CHECK_CHUNK = 2  # compute_logprobs runs before this chunk: weights must be unchanged
RTOL = 1e-6
GRAD_MAX_RTOL = 5 * RTOL  # element-wise gradient bound, relative to the tensor's max

CASES = [
    # name, world, tp, pp, loss_agg, kl_coef, tis_cap; DP = world / (tp * pp)
    ("tp2-token_mean", 2, 2, 1, "token_mean", 0.0, 0.0),
    ("tp2-seq_mean_token_mean-kl", 2, 2, 1, "seq_mean_token_mean", 0.05, 0.0),
    ("tp2-seq_mean_token_sum-tis", 2, 2, 1, "seq_mean_token_sum", 0.0, 1.5),
    ("pp2-token_mean-kl", 2, 1, 2, "token_mean", 0.05, 0.0),
    ("pp2-seq_mean_token_sum", 2, 1, 2, "seq_mean_token_sum", 0.0, 0.0),
    ("dp2-seq_mean_token_mean", 2, 1, 1, "seq_mean_token_mean", 0.0, 0.0),
    ("dp2-token_mean-kl-tis", 2, 1, 1, "token_mean", 0.05, 1.5),
    ("tp2dp2-token_mean-kl", 4, 2, 1, "token_mean", 0.05, 0.0),
    ("pp2dp2-seq_mean_token_mean", 4, 1, 2, "seq_mean_token_mean", 0.0, 0.0),
]


def _prepare(worker, samples, seed: int) -> None:
    """Old/reference/engine logprobs = current ones plus seeded noise (identical on every rank):
    ratios off 1 (some clipped), a KL term with a gradient, TIS weights that vary."""
    current = worker.compute_logprobs(samples)
    g = torch.Generator().manual_seed(seed)
    for s, lp in zip(samples, current):
        lp = torch.tensor(lp)
        s.old_logprobs = (lp + 0.15 * torch.randn(len(lp), generator=g)).tolist()
        if worker.cfg.algorithm.kl_coef > 0:
            s.ref_logprobs = (lp + 0.2 * torch.randn(len(lp), generator=g)).tolist()
        if worker.cfg.algorithm.tis_cap > 0:
            s.engine_logprobs = (torch.tensor(s.old_logprobs) + 0.3 * torch.randn(len(lp), generator=g)).tolist()


def _error_cases(worker, samples, loss_fn) -> dict[str, str]:
    """The refusals, each raised on every rank before any collective (so nothing hangs)."""
    out = {}

    def record(name, fn):
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the type is what the test checks
            out[name] = f"{type(exc).__name__}: {exc}"

    record("apply_nothing", lambda: worker.apply_accumulated_gradients(10, 2))
    worker.accumulate_gradients([], loss_fn)  # an empty chunk accumulates nothing
    record("apply_after_empty_chunk", lambda: worker.apply_accumulated_gradients(10, 2))
    worker.accumulate_gradients(samples[:2], loss_fn)
    record("train_step_while_pending", lambda: worker.train_step(samples, loss_fn))
    record("apply_zero_totals", lambda: worker.apply_accumulated_gradients(0, 0))
    worker.discard_accumulated_gradients()
    record("apply_after_discard", lambda: worker.apply_accumulated_gradients(10, 2))
    worker.cfg.algorithm.ppo_mini_batches = 2
    record("ppo_mini_batches_2", lambda: worker.accumulate_gradients(samples[:2], loss_fn))
    worker.cfg.algorithm.ppo_mini_batches = 1
    return out


def stream_scenarios(rank: int, world: int, port: int, model_dir: str, cases: list, samples) -> list | None:
    from megatron_rl.algorithms.losses import compute_policy_loss
    from megatron_rl.training.megatron_worker import MegatronWorker
    from megatron_rl.training.step_metrics import combine_over_ranks

    results = []
    for index, (name, _, tp, pp, loss_agg, kl_coef, tis_cap) in enumerate(cases):
        cfg = policy_loss_cfg(tp, pp, loss_agg, kl_coef, tis_cap)
        loss_fn = functools.partial(compute_policy_loss, cfg=cfg.algorithm)
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dir)
        batch = [dataclasses.replace(s) for s in samples]  # fresh copies: _prepare fills fields
        _prepare(worker, batch, seed=100 + index)
        initial = worker.export_hf_state_dict()
        lo, hi = CHUNKS[LOGPROB_CHECK_CHUNK]
        initial_logprobs = worker.compute_logprobs(batch[lo:hi])  # same packing as the later call

        ref_metrics = worker.train_step(batch, loss_fn)
        ref = {"grads": worker.export_hf_grads(), "weights": worker.export_hf_state_dict(), "metrics": ref_metrics}

        worker.load_hf(model_dir)  # same initial weights, fresh Adam state
        chunk_metrics, logprobs_mid = [], None
        for k, (lo, hi) in enumerate(CHUNKS):
            if k == LOGPROB_CHECK_CHUNK:
                logprobs_mid = worker.compute_logprobs(batch[lo:hi])
            # Each rank answers its own chunk metrics (one rank per replica reports); PolicyGroup adds them up.
            chunk_metrics.append(combine_over_ranks(worker.accumulate_gradients(batch[lo:hi], loss_fn)))
        stream_metrics = worker.apply_accumulated_gradients(
            sum(len(s.response_ids) for s in batch), len(batch))
        stream = {"grads": worker.export_hf_grads(), "weights": worker.export_hf_state_dict(),
                  "metrics": stream_metrics, "chunk_metrics": chunk_metrics}
        entry = {"name": name, "dp": worker.dp_size, "initial": initial, "ref": ref, "stream": stream,
                 "logprobs_mid_ok": logprobs_mid == initial_logprobs}
        if index == 0:
            entry["errors"] = _error_cases(worker, batch, loss_fn)
        worker.shutdown(destroy_world=index == len(cases) - 1)
        results.append(entry)
    return results if rank == 0 else None


SUBSET_CASES = [
    # name, world, tp, pp, loss_agg, kl_coef, tis_cap: DP2, replica 1 freed while replica 0's engine generates
    ("freed-dp2-seq_mean_token_mean", 2, 1, 1, "seq_mean_token_mean", 0.0, 0.0),
    ("freed-dp2-token_mean-kl-tis", 2, 1, 1, "token_mean", 0.05, 1.5),
    ("freed-dp2-seq_mean_token_sum-kl", 2, 1, 1, "seq_mean_token_sum", 0.05, 0.0),
    ("freed-tp2dp2-token_mean-kl-tis", 4, 2, 1, "token_mean", 0.05, 1.5),
    ("freed-pp2dp2-seq_mean_token_sum-tis", 4, 1, 2, "seq_mean_token_sum", 0.0, 1.5),
]
FREED = [1]
"""The DP replica the released engine frees (replica 0, rank 0's, keeps generating)."""
STREAM_END = 6
"""Samples streamed before the round ends (the chunks of CHUNKS below it); the rest come after."""


def _counting_forwards(counter: list[int]):
    """Patch the worker modules' microbatch runner to count the forward passes this rank runs."""
    from megatron_rl.training import gradient_steps, logprobs, megatron_worker

    real = logprobs.run_microbatches

    def counted(model, mbs, *args, **kwargs):
        counter[0] += len(mbs)
        return real(model, mbs, *args, **kwargs)

    gradient_steps.run_microbatches = megatron_worker.run_microbatches = counted
    return real


def freed_scenarios(rank: int, world: int, port: int, model_dir: str, cases: list, samples) -> list | None:
    """Each case: the ordinary step, then the freed replica streams alone and both take the rest."""
    from megatron_rl.algorithms.losses import compute_policy_loss
    from megatron_rl.training import gradient_steps, megatron_worker
    from megatron_rl.training.megatron_worker import MegatronWorker
    from megatron_rl.training.rank_batches import replica_shares

    results = []
    for index, (name, _, tp, pp, loss_agg, kl_coef, tis_cap) in enumerate(cases):
        cfg = policy_loss_cfg(tp, pp, loss_agg, kl_coef, tis_cap)
        loss_fn = functools.partial(compute_policy_loss, cfg=cfg.algorithm)
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dir)
        batch = [dataclasses.replace(s) for s in samples]
        _prepare(worker, batch, seed=200 + index)
        initial = worker.export_hf_state_dict()
        initial_logprobs = worker.compute_logprobs(batch)
        ref_metrics = worker.train_step(batch, loss_fn)
        ref = {"grads": worker.export_hf_grads(), "weights": worker.export_hf_state_dict(), "metrics": ref_metrics}

        worker.load_hf(model_dir)
        counter = [0]
        real = _counting_forwards(counter)
        prior: dict[int, float] = {}
        logprobs_ok = True
        try:
            for lo, hi in [c for c in CHUNKS if c[1] <= STREAM_END]:  # the round: the freed replica alone
                chunk = batch[lo:hi]
                shares = replica_shares([s.num_tokens for s in chunk], FREED, prior)
                for replica, idx in shares.items():
                    prior[replica] = prior.get(replica, 0.0) + sum(chunk[i].num_tokens for i in idx)
                if worker.dp_rank in FREED:
                    mine = [chunk[i] for i in shares[worker.dp_rank]]
                    scored = worker.compute_logprobs(mine, own=True)
                    if scored is not None:
                        logprobs_ok &= scored == [initial_logprobs[lo + i] for i in shares[worker.dp_rank]]
                    worker.accumulate_gradients(mine, loss_fn, own=True)
            forwards_while_streaming = counter[0]
            rest = batch[STREAM_END:]  # the round is over: every replica, evening out the tokens
            shares = replica_shares([s.num_tokens for s in rest], [0, 1], prior)
            worker.accumulate_gradients([rest[i] for i in shares[worker.dp_rank]], loss_fn, own=True)
        finally:
            gradient_steps.run_microbatches = megatron_worker.run_microbatches = real
        stream_metrics = worker.apply_accumulated_gradients(sum(len(s.response_ids) for s in batch), len(batch))
        stream = {"grads": worker.export_hf_grads(), "weights": worker.export_hf_state_dict(), "metrics": stream_metrics}
        forwards: list = [None] * world
        torch.distributed.all_gather_object(forwards, (worker.dp_rank, forwards_while_streaming, logprobs_ok))
        results.append({"name": name, "dp": worker.dp_size, "initial": initial, "ref": ref, "stream": stream,
                        "forwards_while_streaming": forwards})
        worker.shutdown(destroy_world=index == len(cases) - 1)
    return results if rank == 0 else None


LR, ADAM_EPS = 1e-3, 1e-8  # policy_loss_cfg's lr; Megatron's default adam_eps


def _param_check(r: dict, name: str) -> tuple[float, int, float]:
    """(worst |p_stream - p_ref| / allowance, number of elements where the Adam term is
    negligible, their max |p_stream - p_ref| / max|p_ref|) for one tensor; see the module
    docstring. The allowance depends on the reference run and the tolerances only."""
    g_ref = r["ref"]["grads"][name].double()
    p_ref, p_stream = r["ref"]["weights"][name].double(), r["stream"]["weights"][name].double()
    base = RTOL * float(p_ref.abs().max())
    grad_tol = GRAD_MAX_RTOL * float(g_ref.abs().max())
    # Steepest slope of g / (|g| + eps) within grad_tol of g_ref (1/eps if the sign may flip).
    slope = ADAM_EPS / ((g_ref.abs() - grad_tol).clamp(min=0.0) + ADAM_EPS) ** 2
    adam_term = LR * grad_tol * slope
    diff = (p_stream - p_ref).abs()
    plain = adam_term < 0.1 * base
    plain_rel = float(diff[plain].max()) / float(p_ref.abs().max()) if plain.any() else 0.0
    return float((diff / (base + adam_term)).max()), int(plain.sum()), plain_rel


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    samples = make_samples(NUM_SAMPLES, seed=3)
    results = {}
    for world in sorted({c[1] for c in CASES}):  # one set of spawned ranks per world size
        cases = [c for c in CASES if c[1] == world]
        out = tmp_path_factory.mktemp(f"stream_spmd{world}")
        for r in run_spmd(stream_scenarios, world, (str(tiny_model_dir), cases, samples), out, timeout_s=240)[0]:
            results[r["name"]] = r
    return results


@pytest.fixture(scope="module")
def freed_runs(tiny_model_dir, tmp_path_factory):
    samples = make_samples(NUM_SAMPLES, seed=5)
    results = {}
    for world in sorted({c[1] for c in SUBSET_CASES}):
        cases = [c for c in SUBSET_CASES if c[1] == world]
        out = tmp_path_factory.mktemp(f"freed_spmd{world}")
        for r in run_spmd(freed_scenarios, world, (str(tiny_model_dir), cases, samples), out, timeout_s=240)[0]:
            results[r["name"]] = r
    return results


def _compare(r: dict, case: str) -> None:
    """The streamed step against the ordinary one (the module docstring's tolerances)."""
    ref, stream = r["ref"], r["stream"]
    assert sorted(stream["grads"]) == sorted(ref["grads"])
    diff_sq = ref_sq = grad_max = param_ratio = 0.0
    plain = total = 0
    for name, g in ref["grads"].items():
        diff = (stream["grads"][name] - g).double()
        diff_sq, ref_sq = diff_sq + float(diff.norm()) ** 2, ref_sq + float(g.double().norm()) ** 2
        grad_max = max(grad_max, float(diff.abs().max()) / float(g.abs().max()))
        ratio, count, _ = _param_check(r, name)
        param_ratio, plain, total = max(param_ratio, ratio), plain + count, total + g.numel()
    grad_norm = (diff_sq / ref_sq) ** 0.5
    print(f"{case}: gradient |diff|/|g| {grad_norm:.2e}, worst tensor max-diff/max {grad_max:.2e}; "
          f"parameters worst diff/allowance {param_ratio:.2f}")
    assert grad_norm <= RTOL, (case, grad_norm)
    assert grad_max <= GRAD_MAX_RTOL, (case, grad_max)
    assert param_ratio <= 1.0, (case, param_ratio)
    assert plain >= 0.98 * total, (case, plain / total)
    assert any(not torch.equal(ref["weights"][n], r["initial"][n]) for n in ref["grads"])


@pytest.mark.parametrize("case", [c[0] for c in SUBSET_CASES])
def test_a_step_streamed_on_the_freed_replica_equals_the_ordinary_step(freed_runs, case):
    r = freed_runs[case]
    assert r["dp"] == 2
    _compare(r, case)
    ref, stream = r["ref"]["metrics"], r["stream"]["metrics"]
    for key, value in ref.items():
        if key not in ("time_s", "torch_threads"):
            assert stream[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("case", [c[0] for c in SUBSET_CASES])
def test_only_the_freed_replicas_ranks_computed_while_streaming(freed_runs, case):
    """Replica 0's ranks (beside the engine that keeps generating) ran no forward pass during the round;
    every rank of the freed replica did, and its logprobs of its share equal the ordinary ones."""
    per_rank = freed_runs[case]["forwards_while_streaming"]
    assert all(n == 0 for dp, n, _ in per_rank if dp not in FREED), per_rank
    assert all(n > 0 and ok for dp, n, ok in per_rank if dp in FREED), per_rank


def test_layouts_cover_tp_pp_dp(runs):
    assert {(c[2], c[3], runs[c[0]]["dp"]) for c in CASES} >= {(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)}
    assert len(runs) == len(CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_streamed_step_equals_ordinary_step(runs, case):
    r = runs[case]
    ref, stream = r["ref"], r["stream"]
    assert sorted(stream["grads"]) == sorted(ref["grads"])
    diff_sq = ref_sq = grad_max = param_ratio = plain_rel = 0.0
    plain = total = 0
    for name, g in ref["grads"].items():
        diff = (stream["grads"][name] - g).double()
        diff_sq, ref_sq = diff_sq + float(diff.norm()) ** 2, ref_sq + float(g.double().norm()) ** 2
        grad_max = max(grad_max, float(diff.abs().max()) / float(g.abs().max()))
        ratio, count, rel = _param_check(r, name)
        param_ratio, plain, total = max(param_ratio, ratio), plain + count, total + g.numel()
        plain_rel = max(plain_rel, rel)
    grad_norm = (diff_sq / ref_sq) ** 0.5
    print(f"{case}: gradient |diff|/|g| {grad_norm:.2e}, worst tensor max-diff/max {grad_max:.2e}; "
          f"parameters worst diff/allowance {param_ratio:.2f}, plain regime ({plain / total:.2%} of elements) "
          f"max-diff/max {plain_rel:.2e}")
    assert grad_norm <= RTOL, (case, grad_norm)
    assert grad_max <= GRAD_MAX_RTOL, (case, grad_max)
    assert param_ratio <= 1.0, (case, param_ratio)
    assert plain >= 0.98 * total, (case, plain / total)
    # The step really moved the weights (a no-op step would pass the comparisons above).
    assert any(not torch.equal(ref["weights"][n], r["initial"][n]) for n in ref["grads"])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_streamed_metrics_equal_train_step_metrics(runs, case):
    r = runs[case]
    ref, stream = r["ref"]["metrics"], r["stream"]["metrics"]
    assert set(ref) == set(stream)
    for key in ("tokens", "num_tokens", "num_seqs", "optimizer_steps", "lr", "clip_frac_low", "clip_frac_high"):
        if key in ref:
            assert stream[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), key
    for key, value in ref.items():
        if key != "time_s":
            assert stream[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # Chunk metrics are raw sums: they add up to the batch's counts and un-normalised loss.
    chunks = r["stream"]["chunk_metrics"]
    assert chunks[1] == {}  # the empty chunk computed nothing
    assert sum(c.get("num_tokens", 0.0) for c in chunks) == ref["num_tokens"]
    norm = ref["tokens"] if case.split("-")[1] == "token_mean" else NUM_SAMPLES
    assert sum(c.get("loss", 0.0) for c in chunks) / norm == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    if "kl" in case.split("-"):
        assert ref["kl_loss"] != 0.0 and "kl_ref" in ref
    if "tis" in case.split("-"):
        assert "tis_weight_mean" in ref and ref["tis_clip_frac"] > 0
    assert ref["clip_frac_low"] + ref["clip_frac_high"] > 0  # the clipped branch is exercised


def test_compute_logprobs_between_chunks_sees_unchanged_weights(runs):
    assert all(r["logprobs_mid_ok"] for r in runs.values())


def test_refusals(runs):
    expected = {  # call -> (exception type, words in its message)
        "apply_nothing": ("RuntimeError", "nothing accumulated"),
        "apply_after_empty_chunk": ("RuntimeError", "nothing accumulated"),
        "train_step_while_pending": ("RuntimeError", "pending"),
        "apply_zero_totals": ("ValueError", "must be > 0"),
        "apply_after_discard": ("RuntimeError", "nothing accumulated"),
        "ppo_mini_batches_2": ("ValueError", "ppo_mini_batches == 1"),
    }
    errors = runs[CASES[0][0]]["errors"]
    for call, (kind, words) in expected.items():
        assert errors[call].startswith(kind + ":") and words in errors[call], (call, errors[call])

# ----------------------------------------------------------------------------- driver handle
class _FakeActor:
    """Stands in for a Ray actor handle: ``method.remote(...)`` returns an awaitable that
    resolves later (a real ObjectRef is awaitable the same way)."""

    def __init__(self, rank: int, calls: list, delay_s: float | None) -> None:
        self.rank, self.calls, self.delay_s = rank, calls, delay_s

    def __getattr__(self, method: str):
        actor = self

        class _Method:
            @staticmethod
            def remote(*args):
                actor.calls.append((actor.rank, method, args))
                future = asyncio.get_running_loop().create_future()
                if actor.delay_s is not None:  # None: the rank never answers
                    # A rank's accumulate_gradients answers its chunk metrics; the rest, who answered.
                    answer = {"n": 1.0} if args and args[0] == "accumulate_gradients" else (actor.rank, method)
                    asyncio.get_running_loop().call_later(actor.delay_s, future.set_result, answer)
                return future

        return _Method


def _fake_group(delay_s: float | None):
    from megatron_rl.training.policy_group import PolicyGroup

    group = object.__new__(PolicyGroup)  # no Ray: only the call plumbing is under test
    calls: list = []
    group.actors = [_FakeActor(rank, calls, delay_s) for rank in range(2)]
    group.where, group.broken, group._in_flight = ["rank 0", "rank 1"], "", {}
    return group, calls


def test_policy_group_calls_reach_every_rank_through_one_forwarder_without_blocking_the_loop():
    async def main():
        group, calls = _fake_group(delay_s=0.05)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        summed = await group.accumulate_gradients(["s"])
        results = [await group.compute_logprobs(["s"], which="reference"),
                   await group.apply_accumulated_gradients(7, 3)]
        task.cancel()
        return summed, results, calls, ticks

    summed, results, calls, ticks = asyncio.run(main())
    assert results == [(0, "call")] * 2  # rank 0's answer
    assert summed == {"n": 2.0}  # each rank's chunk metrics, added up
    sent = [("accumulate_gradients", ["s"]), ("compute_logprobs", ["s"], "reference"),
            ("apply_accumulated_gradients", 7, 3)]
    assert calls == [(rank, "call", args) for args in sent for rank in (0, 1)]
    assert ticks >= 5  # the loop kept running while the ranks worked


def test_policy_group_calls_on_some_replicas_reach_only_their_ranks():
    """``replicas=[1]`` (the replica a released engine freed): only its ranks are called, each with its own
    share; the rest after the round is split over both replicas so that their tokens even out."""
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.sample import Prompt, Sample

    def sample(i: int, n: int) -> Sample:
        return Sample(prompt=Prompt(prompt_id=f"p{i}", token_ids=[1] * 2, answer=""), response_index=0,
                      request_id=f"r{i}", response_ids=[3] * n)

    async def main():
        group, calls = _fake_group(delay_s=0.0)
        cfg = RunConfig()
        cfg.parallel.data_parallel_size = 2
        group.cfg, group._replicas, group._replica_tokens = cfg, [(0,), (1,)], {}
        streamed = [sample(0, 10), sample(1, 4)]
        await group.accumulate_gradients(streamed, replicas=[1])
        rest = [sample(2, 10), sample(3, 4), sample(4, 2)]
        await group.accumulate_gradients(rest, replicas=[0, 1])
        return calls

    calls = asyncio.run(main())
    first = [(rank, args) for rank, _, args in calls[:1]]
    assert [rank for rank, _, _ in calls[:1]] == [1] and len(calls) == 3
    assert [s.request_id for s in first[0][1][1]] == ["r0", "r1"] and first[0][1][2] is True
    shares = {rank: [s.request_id for s in args[1]] for rank, _, args in calls[1:]}
    # Replica 1 streamed 18 tokens: replica 0 takes the two longest of the rest (18), replica 1 the last.
    assert shares == {0: ["r2", "r3"], 1: ["r4"]}


def test_policy_group_call_times_out(monkeypatch):
    from megatron_rl.training import policy_group

    monkeypatch.setattr(policy_group, "CALL_TIMEOUT_S", 0.05)
    group, _ = _fake_group(delay_s=None)
    with pytest.raises(TimeoutError, match="accumulate_gradients"):
        asyncio.run(group.accumulate_gradients([]))


def test_trainer_rank_forwards_to_the_worker_or_answers_itself():
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.training.policy_group import TrainerRank

    class _Worker:
        def compute_logprobs(self, samples, which):
            return ("logprobs", samples, which)

        def train_step(self, samples, loss_fn):
            return ("trained", samples, loss_fn.keywords["cfg"].clip_high)

    rank = object.__new__(TrainerRank)  # no Megatron: only the dispatch
    rank.cfg, rank.device, rank.worker = RunConfig(), "cpu", _Worker()
    rank.cfg.algorithm.clip_high = 0.28
    assert rank.call("compute_logprobs", ["s"], "policy") == ("logprobs", ["s"], "policy")
    assert rank.call("train_step", ["s"]) == ("trained", ["s"], 0.28)  # the run's loss, built here
    before = torch.get_num_threads()
    try:
        assert rank.call("set_num_threads", 2) is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(AttributeError):
        rank.call("no_such_method")
    with pytest.raises(ValueError):
        asyncio.run(_fake_group(0.0)[0].set_num_threads(0))

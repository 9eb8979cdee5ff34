"""The trainer's two memory features on real Megatron-Core over gloo (2 spawned ranks, fp32).

Activation recomputation (``parallel.recompute_granularity``): for TP2 and PP2, one train step
with 'selective' (core attention) and 'full' (every layer, uniform, 1 layer per unit) gives the
same gradient, metrics and updated weights as the step without recomputation. Recomputation
replays the same fp32 operations on the same inputs, so the comparison is strict: gradient
``||g - g_none|| <= 1e-6 ||g_none||`` (measured: bit-identical) and weights within 1e-7 of the
largest weight. That the recomputation really ran is checked by counting Megatron's
``tensor_parallel.checkpoint`` calls, and what it saves by summing the bytes autograd keeps for
backward in one training forward (parameters excluded).

Trainer offload (``trainer.offload_during_rollout``): for TP2 (with a reference model) and DP2,
``offload_for_rollout`` after a step leaves the DDP grad
buffers at 0 bytes, ``reload_for_training`` brings them back zeroed, and the next step's weights
are bit-identical to those of a run without offload. The GPU-only parts (optimizer state and
weights to host memory) are forced on as CPU-to-CPU copies in a second pass, with the reload left
to the next call's automatic one.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from tests.helpers.megatron_cases import make_samples, run_spmd, toy_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]  # name, TP, PP (world 2)
# name, TP (world 2). Megatron's distributed optimizer accepts CUDA tensors only, so the DDP
# parameter-buffer path of the weight offload (distributed optimizer) cannot run here.
OFFLOAD_LAYOUTS = [("tp2", 2), ("dp2", 1)]
RTOL = 1e-6


def _cfg(tp: int, pp: int = 1, recompute: str = "none"):
    from megatron_rl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.parallel.recompute_granularity = recompute
    cfg.optimizer.micro_batch_tokens = 64  # a few microbatches per rank
    cfg.optimizer.grad_clip = 0.0  # the exported gradient is the raw one
    cfg.optimizer.lr = 1e-3
    cfg.algorithm.recompute_old_logprobs = True  # the steps are given their old logprobs
    return cfg


def _with_old_logprobs(worker, samples, seed: int) -> list:
    """Copies of ``samples`` whose old logprobs are the current ones plus noise (so the toy loss's
    quadratic term has a gradient); identical on every rank."""
    batch = [dataclasses.replace(s) for s in samples]
    g = torch.Generator().manual_seed(seed)
    for s, lp in zip(batch, worker.compute_logprobs(batch)):
        s.old_logprobs = (torch.tensor(lp) + 0.1 * torch.randn(len(lp), generator=g)).tolist()
    return batch


class _CountCheckpoints:
    """Counts Megatron's tensor_parallel.checkpoint calls (both recompute kinds go through it)."""

    def __enter__(self):
        from megatron.core import tensor_parallel

        self.calls, self._orig = 0, tensor_parallel.checkpoint

        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        tensor_parallel.checkpoint = counting
        return self

    def __exit__(self, *exc):
        from megatron.core import tensor_parallel

        tensor_parallel.checkpoint = self._orig
        return False


def _saved_activation_bytes(worker, samples) -> int:
    """Bytes autograd keeps for backward after one training-mode forward of this rank's first
    microbatch: storages packed by saved-tensor hooks, parameters excluded (TP only: PP stages
    need an input tensor)."""
    from megatron_rl.distributed.cpu_shim import cpu_device_mode

    batch = worker._my_microbatches(samples, fields=False)[0]
    params = {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    worker.model.train()
    with cpu_device_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = worker.model(batch.tokens, batch.position_ids, None)
    del out
    return sum(saved.values())


def _recompute_runs(rank, world, port, model_dir, samples) -> list:
    from megatron.core.utils import get_model_config

    from megatron_rl.training.megatron_worker import MegatronWorker

    results = []
    for name, tp, pp in RECOMPUTE_LAYOUTS:
        batch = None
        for granularity in GRANULARITIES:
            worker = MegatronWorker(_cfg(tp, pp, granularity), rank, world, "127.0.0.1", port)
            worker.load_hf(model_dir)
            batch = batch or _with_old_logprobs(worker, samples, seed=5)
            with _CountCheckpoints() as count:
                metrics = worker.train_step(batch, toy_loss)
            config = get_model_config(worker.model)
            entry = {"layout": name, "granularity": granularity, "metrics": metrics, "checkpoint_calls": count.calls,
                     "grads": worker.export_hf_grads(), "weights": worker.export_hf_state_dict(),
                     "config": (config.recompute_granularity, config.recompute_method,
                                config.recompute_num_layers, list(config.recompute_modules or []))}
            if pp == 1:
                entry["saved_bytes"] = _saved_activation_bytes(worker, batch)
            worker.shutdown(destroy_world=False)
            results.append(entry)
    return results


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def _offload_runs(rank, world, port, model_dir, samples) -> list:
    from megatron_rl.training.megatron_worker import MegatronWorker
    from megatron_rl.training.memory_offload import grad_accumulator_ids, grad_buffer_bytes

    results = []
    for name, tp in OFFLOAD_LAYOUTS:
        cfg = _cfg(tp)
        cfg.model.use_reference_model = name == "tp2"
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dir)
        first = _with_old_logprobs(worker, samples, seed=11)
        second = _with_old_logprobs(worker, samples[::-1], seed=12)
        # Reference: two steps (the second uses Adam state of the first) with nothing offloaded.
        worker.train_step(first, toy_loss)
        ref_logprobs = worker.compute_logprobs(second)
        reference_logprobs = worker.compute_logprobs(second, "reference") if cfg.model.use_reference_model else None
        worker.train_step(second, toy_loss)
        entry = {"layout": name, "ref_weights": worker.export_hf_state_dict()}
        for forced in (False, True):
            worker.load_hf(model_dir)  # same initial weights, fresh optimizer
            if forced:  # the GPU path's bookkeeping, as CPU-to-CPU copies
                worker._offload.move_optimizer = worker._offload.move_weights = True
            worker.train_step(first, toy_loss)
            param_ids, accumulators = [id(p) for p in worker.model.parameters()], grad_accumulator_ids(worker.model)
            grads_before = grad_buffer_bytes(worker.model)
            rss_before = _rss_bytes()
            # The forced run offloads in the tensor push's two parts: grad buffers first, the rest after.
            freed = worker.free_grad_buffers() if forced else None
            stats = worker.offload_for_rollout()
            run = {"stats": stats, "grads_before": grads_before, "grads_offloaded": grad_buffer_bytes(worker.model),
                   "freed_first": freed,
                   "rss_freed": rss_before - _rss_bytes(), "again": worker.offload_for_rollout(),
                   "param_bytes_offloaded": sum(p.untyped_storage().nbytes() for p in worker.model.parameters()),
                   "same_params": [id(p) for p in worker.model.parameters()] == param_ids}
            if forced:  # no explicit reload: compute_logprobs must reload by itself
                run["logprobs_equal"] = worker.compute_logprobs(second) == ref_logprobs
                run["auto_reloads"] = worker._offload.auto_reloads
                if reference_logprobs is not None:  # the frozen reference model came back too
                    run["reference_equal"] = worker.compute_logprobs(second, "reference") == reference_logprobs
                run["reload"] = worker.reload_for_training()  # nothing left to reload
            else:
                run["reload"] = worker.reload_for_training()
                run["grad_buffers_zero"] = all(not bool(b.grad_data.any()) for b in worker.model.buffers)
                run["logprobs_equal"] = worker.compute_logprobs(second) == ref_logprobs
            run["grads_reloaded"] = grad_buffer_bytes(worker.model)
            run["same_accumulators"] = grad_accumulator_ids(worker.model) == accumulators
            worker.train_step(second, toy_loss)
            run["weights"] = worker.export_hf_state_dict()
            entry["forced" if forced else "plain"] = run
        worker.accumulate_gradients(first, toy_loss)
        try:
            worker.offload_for_rollout()
            entry["pending_refusal"] = "no error"
        except RuntimeError as exc:
            entry["pending_refusal"] = str(exc)
        worker.shutdown(destroy_world=False)
        results.append(entry)
    return results


def memory_scenarios(rank: int, world: int, port: int, model_dir: str, samples) -> dict | None:
    out = {"recompute": _recompute_runs(rank, world, port, model_dir, samples),
           "offload": _offload_runs(rank, world, port, model_dir, samples)}
    from megatron_rl.distributed.process_groups import destroy_process_groups

    destroy_process_groups(destroy_world=True)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_spmd")
    return run_spmd(memory_scenarios, 2, (str(tiny_model_dir), make_samples(10, seed=4)), out, timeout_s=500)[0]


def _recompute(runs, layout, granularity):
    return next(r for r in runs["recompute"] if r["layout"] == layout and r["granularity"] == granularity)


@pytest.mark.parametrize("layout", [name for name, _, _ in RECOMPUTE_LAYOUTS])
@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_step_equals_stored_activation_step(runs, layout, granularity):
    ref, r = _recompute(runs, layout, "none"), _recompute(runs, layout, granularity)
    assert sorted(r["grads"]) == sorted(ref["grads"])
    diff_sq = sum(float((r["grads"][n] - g).double().norm()) ** 2 for n, g in ref["grads"].items())
    ref_sq = sum(float(g.double().norm()) ** 2 for g in ref["grads"].values())
    weight_diff = max(float((r["weights"][n] - w).abs().max()) / float(w.abs().max())
                      for n, w in ref["weights"].items())
    print(f"{layout} {granularity}: gradient |diff|/|g| {(diff_sq / ref_sq) ** 0.5:.2e}, "
          f"weights max diff/max {weight_diff:.2e}, checkpoint calls {r['checkpoint_calls']}")
    assert (diff_sq / ref_sq) ** 0.5 <= RTOL
    assert weight_diff <= 1e-7
    for key, value in ref["metrics"].items():
        if key != "time_s":
            assert r["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_recompute_runs_and_saves_activation_memory(runs):
    layers_per_stage = {"tp2": 2, "pp2": 1}  # the tiny model has 2 layers
    for name, _, _ in RECOMPUTE_LAYOUTS:
        none, sel, full = (_recompute(runs, name, g) for g in GRANULARITIES)
        assert none["config"][:3] == (None, None, None) and none["checkpoint_calls"] == 0
        assert sel["config"] == ("selective", None, None, ["core_attn"])
        assert full["config"][:3] == ("full", "uniform", 1)
        # One checkpoint per layer per training microbatch (logprob passes do not recompute).
        assert full["checkpoint_calls"] == sel["checkpoint_calls"] > 0
        assert full["checkpoint_calls"] % layers_per_stage[name] == 0
    none, sel, full = (_recompute(runs, "tp2", g)["saved_bytes"] for g in GRANULARITIES)
    print(f"tp2 saved activations of one microbatch: none {none} B, selective {sel} B, full {full} B")
    # Local (non-flash) attention keeps the s^2 scores: selective drops them; full keeps only the
    # layer inputs (and the final norm / output layer's own tensors).
    assert full < sel < none and full < 0.5 * none


@pytest.mark.parametrize("layout", [name for name, _ in OFFLOAD_LAYOUTS])
def test_offload_frees_grad_buffers_and_reload_is_exact(runs, layout):
    r = next(e for e in runs["offload"] if e["layout"] == layout)
    plain = r["plain"]
    print(f"{layout}: offload freed {plain['stats']['grad_buffers_freed']} B of grad buffers "
          f"(process RSS change {-plain['rss_freed']:+d} B: glibc keeps freed chunks this small); "
          f"reload {plain['reload']}")
    assert plain["grads_before"] == plain["stats"]["grad_buffers_freed"] > 0
    assert plain["grads_offloaded"] == 0
    assert plain["stats"]["optimizer_to_host"] == plain["stats"]["weights_to_host"] == 0  # CPU: in place
    assert plain["again"] == {"grad_buffers_freed": 0, "optimizer_to_host": 0, "weights_to_host": 0}
    assert plain["reload"]["grad_buffers"] == plain["grads_reloaded"] == plain["grads_before"]
    assert plain["grad_buffers_zero"] and plain["logprobs_equal"]
    for name, w in r["ref_weights"].items():
        assert torch.equal(plain["weights"][name], w), name


@pytest.mark.parametrize("layout", [name for name, _ in OFFLOAD_LAYOUTS])
def test_forced_host_offload_of_optimizer_and_weights_round_trips(runs, layout):
    r = next(e for e in runs["offload"] if e["layout"] == layout)
    forced = r["forced"]
    print(f"{layout} forced: {forced['stats']}")
    assert forced["stats"]["optimizer_to_host"] > 0 and forced["stats"]["weights_to_host"] > 0
    # free_grad_buffers took the gradients first (the push's order); the offload then moved only the rest.
    assert forced["freed_first"] == {"grad_buffers_freed": forced["grads_before"]} and forced["grads_before"] > 0
    assert forced["stats"]["grad_buffers_freed"] == 0 and forced["grads_offloaded"] == 0
    # The parameters' storages were emptied in place (the bytes went to host copies and came
    # back): the same parameter objects with the same grad accumulators, which DDP's hooks sit on.
    # (Swapping param.data for a host tensor kept them on this CPU box, but on a GPU the device
    # change drops the accumulator and the next step's gradients never reach main_grad.)
    assert forced["param_bytes_offloaded"] == 0 and forced["stats"]["weights_to_host"] > 0
    assert forced["same_params"] and forced["same_accumulators"]
    assert forced["auto_reloads"] == 1 and forced["logprobs_equal"]
    assert forced.get("reference_equal", True) and ("reference_equal" in forced) == (layout == "tp2")
    assert forced["reload"] == {"grad_buffers": 0, "optimizer": 0, "weights": 0}
    assert forced["grads_reloaded"] == forced["grads_before"]
    for name, w in r["ref_weights"].items():
        assert torch.equal(forced["weights"][name], w), name


def test_offload_refuses_pending_accumulated_gradients(runs):
    for r in runs["offload"]:
        assert "pending" in r["pending_refusal"], r["pending_refusal"]


def test_recompute_granularity_is_validated():
    from megatron_rl.config.loading import load_config
    from megatron_rl.config.validation import validate
    from megatron_rl.config.values import ConfigError

    for value in GRANULARITIES:
        validate(load_config(None, [f"parallel.recompute_granularity={value}"]), device="cpu")
    with pytest.raises(ConfigError, match=r"parallel\.recompute_granularity: 'block' is not one of none, selective"):
        validate(load_config(None, ["parallel.recompute_granularity=block"]), device="cpu")


def test_driver_handles_forward_offload_and_reload_to_every_rank():
    from megatron_rl.training.policy_group import PolicyGroup, TrainerRank

    group, sent = object.__new__(PolicyGroup), []  # no Ray: only the call plumbing

    async def _all(method, *args, ranks=None):
        sent.append((method, args, ranks))
        return [{"rank": r} for r in (ranks or [0, 1])]

    group._all = _all
    assert asyncio.run(group.offload_for_rollout()) == {"rank": 0}
    assert asyncio.run(group.reload_for_training()) == {"rank": 0}
    assert asyncio.run(group.reload_for_training(ranks=[1])) == {"rank": 1}  # a freed replica's ranks alone
    assert sent == [("offload_for_rollout", (), None), ("reload_for_training", (), None), ("reload_for_training", (), [1])]

    class _Worker:
        def offload_for_rollout(self):
            return {"grad_buffers_freed": 1}

        def reload_for_training(self):
            return {"grad_buffers": 1}

    rank = object.__new__(TrainerRank)
    rank.device, rank.worker = "cpu", _Worker()
    assert rank.call("offload_for_rollout") == {"grad_buffers_freed": 1}
    assert rank.call("reload_for_training") == {"grad_buffers": 1}

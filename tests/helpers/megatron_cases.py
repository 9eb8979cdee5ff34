"""SPMD helpers for the Megatron worker tests: spawn N ranks once, run scenarios, collect results.

Imported by the spawned ranks (spawn start method), so keep it free of pytest fixtures.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_rl.distributed.ports import free_port


def policy_loss_cfg(tp: int, pp: int, loss_agg: str, kl_coef: float, tis_cap: float):
    """A worker config for comparing two ways of taking one step: several microbatches per rank
    (micro_batch_tokens 24), no clipping (the exported gradient is the raw one), lr 1e-3, and the
    given layout and loss terms."""
    from megatron_rl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.optimizer.micro_batch_tokens = 24
    cfg.optimizer.grad_clip = 0.0
    cfg.optimizer.lr = 1e-3
    cfg.algorithm.loss_agg = loss_agg
    cfg.algorithm.kl_coef = kl_coef
    cfg.algorithm.tis_cap = tis_cap
    cfg.algorithm.recompute_old_logprobs = True  # the steps are given their old logprobs
    return cfg




def _rank_entry(fn: Callable, rank: int, world: int, port: int, args: tuple, out_dir: str) -> None:
    from tests.helpers.rank_pool import run_scenario, single_threaded, write_result

    single_threaded()
    write_result(out_dir, rank, run_scenario(fn, rank, world, port, args))


def _rank_results(world: int, out_dir: Path) -> tuple[list[Any], str | None]:
    """The pickled results of ranks ``0..world-1`` that wrote one, and the first failure's text."""
    results = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.pkl"
        if not path.is_file():
            continue
        status, value = pickle.loads(path.read_bytes())
        if status == "error":
            return results, f"rank {rank} failed:\n{value}"
        results.append(value)
    return results, None


def run_spmd(fn: Callable, world: int, args: tuple, out_dir: Path, timeout_s: float, fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` on ``world`` ranks; return per-rank results.

    The ranks are this pytest process's pooled ones (``tests.helpers.rank_pool``: started once,
    torn down to a fresh process's state after each scenario); ``fresh=True`` spawns ``world``
    new processes instead, for scenarios that end their processes (a rank killed mid-save) or
    must not share one. Raises if a rank fails or the group does not finish within ``timeout_s``
    (a pooled set is then killed: its ranks may be stuck in a collective).
    """
    from tests.helpers.rank_pool import POOL_SIZE, close_shared_pool, shared_pool

    if fresh or world > POOL_SIZE:
        return _run_spawned(fn, world, args, out_dir, timeout_s)
    try:
        shared_pool().run(fn, world, free_port(), args, out_dir, timeout_s)
        results, failure = _rank_results(world, out_dir)
        if failure is not None:
            raise RuntimeError(failure)
        if len(results) != world:
            raise RuntimeError(f"ranks reported without a result: {len(results)}/{world} finished")
    except BaseException:
        close_shared_pool()
        raise
    return results


def _run_spawned(fn: Callable, world: int, args: tuple, out_dir: Path, timeout_s: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, port, args, str(out_dir))) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        results, failure = _rank_results(world, out_dir)
        if failure is not None:
            raise RuntimeError(failure)
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout_s}s; {len(results)}/{world} finished")
        if len(results) != world:
            codes = {r: p.exitcode for r, p in enumerate(procs)}
            raise RuntimeError(f"ranks exited without a result: {len(results)}/{world} finished, exit codes {codes}")
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# ----------------------------------------------------------------------------- test data
def make_samples(num: int, seed: int, vocab: int = 256):
    """Random token samples of varied lengths with advantages (old_logprobs filled in later).

    Token ids stay below 256, the tiny tokenizer's pad id: transformers' embedding has
    padding_idx=pad and drops that row's lookup gradient, Megatron (like vLLM) does not."""
    from megatron_rl.sample import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        n_p = int(torch.randint(3, 12, (1,), generator=g))
        n_r = int(torch.randint(1, 14, (1,), generator=g))
        prompt = Prompt(prompt_id=f"t:{i}", token_ids=torch.randint(0, vocab, (n_p,), generator=g).tolist(), answer="")
        samples.append(Sample(prompt=prompt, response_index=i % 2,
                              response_ids=torch.randint(0, vocab, (n_r,), generator=g).tolist(),
                              advantage=float(torch.randn(1, generator=g))))
    return samples


def toy_loss(logprobs, old_logprobs, advantages, mask, *, ref_logprobs=None, engine_logprobs=None,
             seq_ids=None, num_tokens_total: int, num_seqs_total: int):
    """-A*logp + 0.5*(logp-old)^2 per token, summed and divided by the full batch's token count."""
    per_token = -advantages * logprobs + 0.5 * (logprobs - old_logprobs) ** 2
    loss = (per_token * mask).sum() / num_tokens_total
    return loss, {"loss": loss, "mask_tokens": mask.sum()}


def hf_reference(model_dir: str, samples) -> tuple[list[list[float]], float, dict[str, torch.Tensor]]:
    """transformers' logprobs, toy loss and gradient for ``samples`` (one sequence at a time)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.zero_grad()
    total = sum(len(s.response_ids) for s in samples)
    logprobs_all, loss_total = [], 0.0
    for s in samples:
        ids = torch.tensor([s.prompt.token_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0].float()
        n_p = len(s.prompt.token_ids)
        lp = torch.log_softmax(logits, -1)[n_p - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        logprobs_all.append(lp.tolist())
        old = torch.tensor(s.old_logprobs) if s.old_logprobs else lp.detach()
        loss = (-s.advantage * lp + 0.5 * (lp - old) ** 2).sum() / total
        loss.backward()
        loss_total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return logprobs_all, loss_total, grads


# ----------------------------------------------------------------------------- scenarios
def _cfg(tp: int, pp: int, budget: int):
    from megatron_rl.config.schema import RunConfig

    cfg = RunConfig()
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.optimizer.micro_batch_tokens = budget
    cfg.optimizer.grad_clip = 0.0
    cfg.optimizer.lr = 1e-3
    cfg.algorithm.recompute_old_logprobs = True  # the steps are given their old logprobs
    return cfg


def parity_scenarios(rank: int, world: int, port: int, model_dirs: dict, layouts: list, samples, ckpt_dir: str):
    """For each (model, tp, pp, budget): logprobs, one train step's grads/metrics, updated weights.
    The first layout also checks a checkpoint save/load round trip. Rank 0 returns the results."""
    from megatron_rl.training.megatron_worker import MegatronWorker

    results = []
    for index, (model, tp, pp, budget) in enumerate(layouts):
        cfg = _cfg(tp, pp, budget)
        cfg.model.use_reference_model = index == 0
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dirs[model])
        logprobs = worker.compute_logprobs(samples[model])
        metrics = worker.train_step(samples[model], toy_loss)
        grads = worker.export_hf_grads()
        weights = worker.export_hf_state_dict()
        entry = {"layout": (model, tp, pp, budget), "logprobs": logprobs, "metrics": metrics, "grads": grads,
                 "weights": weights, "dp": worker.dp_size}
        if index == 0:
            entry["policy_after_step"] = worker.compute_logprobs(samples[model])
            entry["reference_after_step"] = worker.compute_logprobs(samples[model], which="reference")
            entry["checkpoint"] = _checkpoint_round_trip(worker, samples[model], ckpt_dir)
        worker.shutdown(destroy_world=index == len(layouts) - 1)
        results.append(entry)
    return results if rank == 0 else None


def _checkpoint_round_trip(worker, samples, ckpt_dir: str) -> dict:
    """Save, train further, load: params and optimizer state must come back identical."""
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    worker.save_checkpoint(ckpt_dir)
    saved_weights = worker.export_hf_state_dict()
    saved_opt = pickle.dumps(worker.optimizer.state_dict())
    worker.train_step(samples, toy_loss)
    moved = worker.export_hf_state_dict()
    worker.load_checkpoint(ckpt_dir)
    restored = worker.export_hf_state_dict()
    opt_equal = _same_state(pickle.loads(saved_opt), worker.optimizer.state_dict())
    flags = torch.tensor([int(opt_equal)])
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    out = {"optimizer_equal_all_ranks": bool(flags.item())}
    if saved_weights is not None:
        out["changed_by_step"] = any(not torch.equal(moved[k], v) for k, v in saved_weights.items())
        out["restored_equal"] = all(torch.equal(restored[k], v) for k, v in saved_weights.items())
        out["has_adam_state"] = "exp_avg" in repr(worker.optimizer.state_dict())[:100000]
    return out


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b

"""SPMD scenario for tests/integration/test_gpu_rules_shapes.py: one train step and the logprobs of
the project's MegatronWorker at a given TP / sequence-parallel layout, plus the microbatch widths
it built. Imported by the spawned ranks, so keep it free of pytest fixtures."""
from __future__ import annotations

import torch


def odd_width_samples(totals: list[tuple[int, int]], seed: int, vocab: int = 256):
    """Samples with the given (prompt, response) lengths, random tokens below ``vocab``, random
    advantages and old logprobs near 0 (so the toy loss's quadratic term has a gradient)."""
    from megatron_rl.sample import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n_p, n_r) in enumerate(totals):
        prompt = Prompt(prompt_id=f"sp:{i}", token_ids=torch.randint(0, vocab, (n_p,), generator=g).tolist(), answer="")
        sample = Sample(prompt=prompt, response_index=0, response_ids=torch.randint(0, vocab, (n_r,), generator=g).tolist(),
                        advantage=float(torch.randn(1, generator=g)))
        sample.old_logprobs = (-5.5 + 0.1 * torch.randn(n_r, generator=g)).tolist()
        out.append(sample)
    return out


def sp_scenario(rank: int, world: int, port: int, model_dir: str, layouts: list, samples, budget: int):
    """For each (tp, pp, sequence_parallel): the worker's microbatch widths (natural and built, every
    rank's), whether the built model runs SP with tagged norms, the logprobs, one train step's
    metrics and its HF-named gradient (gathered to full shape). Rank 0 returns the results."""
    from megatron.core.utils import get_model_config

    from megatron_rl.config.schema import RunConfig
    from megatron_rl.training.megatron_worker import MegatronWorker
    from tests.helpers.megatron_cases import toy_loss

    results = []
    for index, (tp, pp, sp) in enumerate(layouts):
        cfg = RunConfig()
        cfg.parallel.tensor_model_parallel_size = tp
        cfg.parallel.pipeline_model_parallel_size = pp
        cfg.parallel.sequence_parallel = sp
        cfg.optimizer.micro_batch_tokens = budget
        cfg.optimizer.grad_clip = 0.0  # the exported gradient is the raw one
        cfg.algorithm.recompute_old_logprobs = True  # the step is given its old logprobs
        worker = MegatronWorker(cfg, rank, world, "127.0.0.1", port)
        worker.load_hf(model_dir)
        mine = [(max(len(s.prompt.token_ids) + len(s.response_ids) for s in (samples[i] for i in mb.seq_ids.tolist())),
                 int(mb.tokens.shape[1]), int(mb.tokens.numel()))
                for mb in worker._my_microbatches(samples, fields=True)]
        widths: list = [None] * world
        torch.distributed.all_gather_object(widths, mine)
        norms = [p for n, p in worker.model.named_parameters() if "layernorm" in n]
        entry = {
            "layout": (tp, pp, sp),
            "widths": [w for part in widths for w in part],
            "model_sp": bool(get_model_config(worker.model).sequence_parallel),
            "norms_tagged": bool(norms) and all(getattr(p, "sequence_parallel", False) for p in norms),
            "logprobs": worker.compute_logprobs(samples),
            "metrics": worker.train_step(samples, toy_loss),
            "grads": worker.export_hf_grads(),
        }
        worker.shutdown(destroy_world=index == len(layouts) - 1)
        results.append(entry)
    return results if rank == 0 else None

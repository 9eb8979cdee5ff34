"""GPU rule: under sequence parallelism every microbatch width divides by TP.

Megatron's SP scatter / reduce-scatter assert ``S % TP == 0`` (megatron/core/tensor_parallel/
mappings.py). Checked here on the trainer's own batching path (MegatronWorker._my_microbatches,
no Megatron needed) for the shapes each H800 recipe in examples/qwen2.5/ produces, and on the
packing functions: the extra columns are padding like any other, and nothing changes with SP off.
tests/integration/test_gpu_rules_shapes.py runs the padded batches through Megatron on gloo.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from megatron_rl.config.loading import load_config
from megatron_rl.distributed.process_groups import ParallelLayout
from megatron_rl.sample import Prompt, Sample
from megatron_rl.training.megatron_worker import MegatronWorker
from megatron_rl.training.packing import (
    build_microbatch,
    pack_microbatches,
    padded_width,
    response_values,
    sequence_multiple,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "examples/qwen2.5").glob("qwen2.5_*b_*.yaml"))


def _batching_worker(cfg) -> MegatronWorker:
    """A worker with just what ``_my_microbatches`` reads (one DP rank holding every sample)."""
    worker = MegatronWorker.__new__(MegatronWorker)
    par = cfg.parallel
    worker.cfg, worker.dp_rank, worker.dp_size = cfg, 0, 1
    worker.layout = ParallelLayout(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                   par.context_parallel_size)
    return worker


def _samples(lengths: list[tuple[int, int]]) -> list[Sample]:
    return [Sample(prompt=Prompt(prompt_id=f"w:{i}", token_ids=[1] * n_p, answer=""), response_index=0,
                   response_ids=[2] * n_r) for i, (n_p, n_r) in enumerate(lengths)]


def _recipe_lengths(cfg, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, response) lengths over the recipe's whole range: both extremes, then random
    ones, mostly of odd total (what an unpadded batch would hand Megatron)."""
    max_p, max_r = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    out = [(max_p, max_r), (max_p, max_r - 1), (1, 1), (1, 2)]
    while len(out) < 40:
        n_p, n_r = rng.randint(1, max_p), rng.randint(1, max_r)
        out.append((n_p, n_r - 1 if (n_p + n_r) % 2 == 0 and n_r > 1 else n_r))
    return out


def test_the_recipes_run_tensor_parallel_with_sequence_parallelism():
    assert RECIPES, "no H800 recipes found"
    layouts = {(load_config(p).parallel.tensor_model_parallel_size, load_config(p).parallel.sequence_parallel)
               for p in RECIPES}
    assert {(2, True), (4, True)} <= layouts, layouts  # the cases the rule is about


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_microbatch_widths_divide_by_tp_and_fit_the_budget(recipe):
    cfg = load_config(recipe)
    tp, budget = cfg.parallel.tensor_model_parallel_size, cfg.optimizer.micro_batch_tokens
    multiple = tp if cfg.parallel.sequence_parallel else 1
    lengths = _recipe_lengths(cfg, random.Random(recipe.stem))
    mbs = _batching_worker(cfg)._my_microbatches(_samples(lengths), fields=False)
    assert sorted(int(i) for mb in mbs for i in mb.seq_ids) == list(range(len(lengths)))
    odd = 0
    for mb in mbs:
        rows, width = mb.tokens.shape
        natural = max(lengths[int(i)][0] + lengths[int(i)][1] for i in mb.seq_ids)
        odd += natural % 2
        assert width % multiple == 0, (recipe.stem, natural, width)
        assert natural <= width < natural + multiple
        # micro_batch_tokens divides by TP in every recipe, so even a full-length sequence fits.
        assert rows * width <= budget, (recipe.stem, rows, width, budget)
    assert odd, "no microbatch of odd natural width: the check would prove nothing"


def test_sequence_parallel_off_leaves_the_widths_natural():
    cfg = load_config(RECIPES[0], ["parallel.sequence_parallel=false"])
    assert sequence_multiple(cfg.parallel.tensor_model_parallel_size, False) == 1
    lengths = [(3, 4), (2, 2), (5, 8)]
    for mb in _batching_worker(cfg)._my_microbatches(_samples(lengths), fields=False):
        assert mb.tokens.shape[1] == max(sum(lengths[int(i)]) for i in mb.seq_ids)


def test_padding_columns_are_masked_and_values_unchanged():
    seqs = [([1, 2, 3], [4, 5]), ([7, 8], [9, 10, 11, 12])]  # natural width 6
    fields = {"old_logprobs": [[-0.1, -0.2], [-1.0, -2.0, -3.0, -4.0]]}
    plain = build_microbatch(seqs, [0, 1], token_fields=fields, seq_fields={"advantages": [1.0, -1.0]})
    padded = build_microbatch(seqs, [0, 1], token_fields=fields, seq_fields={"advantages": [1.0, -1.0]},
                              width_multiple=4)
    assert plain.tokens.shape == (2, 6) and padded.tokens.shape == (2, 8)
    for name in ("tokens", "labels", "loss_mask", "segment_ids", "position_ids"):
        assert torch.equal(getattr(padded, name)[:, :6], getattr(plain, name)), name
    assert not padded.loss_mask[:, 6:].any() and (padded.segment_ids[:, 6:] == -1).all()
    assert (padded.tokens[:, 6:] == 0).all() and (padded.labels[:, 6:] == 0).all()
    for name, values in plain.fields.items():
        assert torch.equal(padded.fields[name][:, :6], values) and not padded.fields[name][:, 6:].any()
    per_token = torch.randn(2, 8)
    assert response_values(per_token, padded) == response_values(per_token[:, :6], plain)


def test_pack_counts_the_padded_width_against_the_budget():
    assert [padded_width(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert pack_microbatches([7, 7], 14) == [[0, 1]]  # 2 x 7 fits unpadded
    assert pack_microbatches([7, 7], 14, width_multiple=4) == [[0], [1]]  # 2 x 8 does not
    rng = random.Random(3)
    lengths = [rng.randint(1, 60) for _ in range(100)]
    for b in pack_microbatches(lengths, 128, width_multiple=4):
        assert len(b) * padded_width(max(lengths[i] for i in b), 4) <= 128
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        sequence_multiple(0, True)


def test_the_shim_norm_tags_its_weight_for_the_tp_all_reduce_and_stays_cpu_only(monkeypatch):
    """Megatron all-reduces over TP only the grads of parameters tagged ``sequence_parallel``
    (finalize_model_grads); untagged, each TP rank would keep the norm gradient of its slice."""
    from types import SimpleNamespace

    from megatron_rl.distributed import cpu_shim
    from megatron_rl.model import qwen2

    norm = cpu_shim.SequenceParallelTorchNorm(SimpleNamespace(normalization="RMSNorm", sequence_parallel=True), 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True]
    with pytest.raises(ValueError, match="RMSNorm only"):
        cpu_shim.SequenceParallelTorchNorm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=True), 8)
    monkeypatch.setattr(cpu_shim, "shim_needed", lambda: False)  # as on a GPU machine
    with pytest.raises(RuntimeError, match="CPU shim"):
        cpu_shim.SequenceParallelTorchNorm(SimpleNamespace(normalization="RMSNorm", sequence_parallel=True), 8)
    with pytest.raises(ValueError, match="parallel.sequence_parallel with the local layer spec on GPUs"):
        qwen2._local_spec_with_sequence_parallel_norms(None, None)

"""The trainer starts from a converted Megatron dist checkpoint (``model.megatron_checkpoint``)
at any layout and its own checkpoints export to HF with megatron-rl-convert-checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.tools import convert_checkpoint as cc
from tests.helpers.megatron_cases import hf_reference, make_samples, run_spmd
from tests.helpers.resharding_cases import trainer_from_converted

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_trainer_loads_converted_and_exports_its_checkpoint(tp, pp, tiny_model_dir, tmp_path):
    """One conversion (no layout given) starts trainers of TP2 and of PP2 alike."""
    from megatron_rl.model.tiny import build_tiny_qwen2

    other = build_tiny_qwen2(tmp_path / "other", seed=7)  # same shapes as tiny_model_dir, other weights
    converted = cc.hf_to_megatron(str(other), str(tmp_path / "converted"))
    samples = make_samples(4, seed=3)
    expected_logprobs, _, _ = hf_reference(str(other), samples)
    ckpt = tmp_path / "ckpt"
    result = run_spmd(trainer_from_converted, 2, (str(tiny_model_dir), str(converted), samples, str(ckpt), tp, pp),
                      tmp_path, timeout_s=400)[0]
    for got, want in zip(result["logprobs"], expected_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    original = load_file(str(Path(other) / "model.safetensors"))
    for name, tensor in original.items():
        assert torch.equal(result["weights"][name], tensor), name  # weights came from the converted checkpoint
    assert (ckpt / "megatron" / "metadata.json").is_file()  # the trainer's dist checkpoint
    exported = cc.megatron_to_hf(str(ckpt), str(tmp_path / "exported"), hf_config=str(tiny_model_dir))
    back = load_file(str(exported / "model.safetensors"))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())

"""The quantized checkpoint format against the libraries that define it (no vLLM engine):

* fp8: nvidia-modelopt's own pipeline (``mtq.quantize`` with FP8_PER_CHANNEL_PER_TOKEN_CFG, no
  calibration data, then ``export_hf_checkpoint``) on the tiny model gives bit for bit the
  tensors and the config files our per-sync quantizer writes;
* int8: modelopt's per-channel int8 export (INT8_WEIGHT_ONLY_CFG: the same weight quantizer)
  gives our int8 weights and scales; the compressed-tensors config we write parses with
  compressed-tensors into exactly its W8A8 preset (dynamic per-token activations).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.quantization.engine_format import hf_quant_config, quantization_config, quantize_hf_checkpoint
from megatron_rl.quantization.modelopt_ops import _PLUGIN_PACKAGES, import_without_plugins
from megatron_rl.quantization.scheme import QuantSpec, is_quantized_weight, quantize_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def _modelopt():
    def load():
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        return mtq, export_hf_checkpoint

    # Keep every plug-in but vLLM's (it would import vLLM here): mtq.quantize needs the HF one.
    return import_without_plugins(load, keep=tuple(p for p in _PLUGIN_PACKAGES if p != "vllm"))


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    mtq, export_hf_checkpoint = _modelopt()
    out = {}
    for method, cfg in (("fp8", mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG), ("int8", mtq.INT8_WEIGHT_ONLY_CFG)):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        model = mtq.quantize(model, copy.deepcopy(cfg), forward_loop=None)  # weights only: no calibration data
        target = tmp_path_factory.mktemp(f"modelopt-{method}")
        export_hf_checkpoint(model, export_dir=str(target))
        out[method] = target
    return out


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_our_quantizer_equals_modelopts_export(tiny_model_dir, exported, method):
    theirs = load_file(str(exported[method] / "model.safetensors"))
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    ours = quantize_state_dict(hf, QuantSpec(method))
    quantized = [n for n in hf if is_quantized_weight(n)]
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(quantized) == 7 * layers
    for name in quantized:
        scale = name[: -len("weight")] + "weight_scale"
        assert theirs[name].dtype == ours[name].dtype
        assert torch.equal(theirs[name].view(torch.uint8), ours[name].view(torch.uint8)), name
        # modelopt writes [rows]; compressed-tensors (our int8 format) wants [rows, 1].
        assert torch.equal(theirs[scale], ours[scale].reshape(theirs[scale].shape)), scale
    for name in hf:
        if not is_quantized_weight(name) and name in theirs:  # embeddings, norms, biases unchanged
            assert torch.equal(theirs[name], ours[name]), name


def test_fp8_config_files_equal_modelopts(tiny_model_dir, exported, tmp_path):
    ours = quantize_hf_checkpoint(tiny_model_dir, tmp_path / "q", QuantSpec("fp8"))
    their_config = json.loads((exported["fp8"] / "config.json").read_text())["quantization_config"]
    assert json.loads((ours / "config.json").read_text())["quantization_config"] == their_config
    assert quantization_config(QuantSpec("fp8")) == their_config
    assert json.loads((exported["fp8"] / "hf_quant_config.json").read_text()) == hf_quant_config(QuantSpec("fp8"))
    assert json.loads((ours / "hf_quant_config.json").read_text()) == hf_quant_config(QuantSpec("fp8"))
    written = load_file(str(ours / "model.safetensors"))
    assert "lm_head.weight" not in written and set(written) == set(load_file(str(exported["fp8"] / "model.safetensors")))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_config_is_compressed_tensors_w8a8(symmetric):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    ours = quantization_config(QuantSpec("int8", activation_symmetric=symmetric))
    parsed = QuantizationConfig.model_validate(ours)
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    group = parsed.config_groups["group_0"]
    assert group.targets == preset.targets and group.weights == preset.weights
    want_act = preset.input_activations.model_copy(update={"symmetric": symmetric})
    got_act = group.input_activations
    for field in ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size"):
        assert getattr(got_act, field) == getattr(want_act, field), field
    assert parsed.format == "int-quantized" and parsed.ignore == ["lm_head"] and parsed.quant_method == "compressed-tensors"

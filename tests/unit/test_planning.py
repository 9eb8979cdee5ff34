"""Recipes validate and fit; the per-GPU memory estimate and placement match hand computations."""
import json
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.values import ConfigError
from megatron_rl.planning.architectures import BUILTIN_SHAPES, resolve_shape
from megatron_rl.planning.memory import (
    GIB,
    GPUS,
    MemoryAssumptions,
    PlanError,
    estimate_memory,
    format_memory,
    trainer_params_per_gpu,
)
from megatron_rl.planning.placement import plan_placement
from megatron_rl.planning.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "examples/qwen2.5").glob("qwen2.5_*b_*.yaml"))
# TP PP CP rTP nodes. No context parallelism (refused): the paper's 14B (2,2,2) and 32B (4,1,4) trainer layouts
# became TP4 and TP8 on the same GPUs (the memory moments of tests/unit/test_gpu_rules_memory.py fit 80 GB).
LAYOUT = {"7b": (2, 1, 1, 1, 2), "14b": (4, 1, 1, 2, 4), "32b": (8, 1, 1, 2, 8)}
RECIPE_32B = REPO / "examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml"


def test_all_sizes_and_tasks_present():
    names = {p.name.split("_")[1] + "_" + p.name.split("_")[2] for p in RECIPES}
    assert names == {f"{s}_{t}" for s in ("7b", "14b", "32b") for t in ("math", "code", "mixed")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_fits_an_h800(recipe):
    cfg = load_config(recipe)
    plan = make_plan(cfg)
    size = recipe.name.split("_")[1]
    tp, pp, cp, rtp, nodes = LAYOUT[size]
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size) == (tp, pp, cp)
    assert cfg.rollout.tensor_parallel_size == rtp and cfg.cluster.num_nodes == nodes
    assert tp * pp * cp * p.data_parallel_size == nodes * 8 == rtp * cfg.rollout.num_engines
    assert (cfg.data.prompts_per_step, cfg.data.responses_per_prompt) == (128, 8)
    assert cfg.rollout.max_new_tokens == {"7b": 8192, "14b": 16384, "32b": 32768}[size]
    assert plan.memory.fits and plan.memory.rollout_peak_gib <= 80 and plan.memory.train_peak_gib <= 80
    assert plan.memory.concurrent_full_sequences >= 4  # room for several full-length responses per engine
    assert recipe.read_text().startswith("# Qwen2.5-")  # header says what it expects
    task = recipe.name.split("_")[2]
    assert cfg.reward.kind == {"code": "code", "math": "math", "mixed": "mixed"}[task]
    assert cfg.data.format == {"code": "kodcode", "math": "deepmath", "mixed": "auto"}[task]
    assert cfg.scheduler.name == "tail_batching"  # RollPacker recipes; scheduler.name=baseline for veRL-style
    if size == "32b":  # fits only with both memory features
        assert cfg.parallel.recompute_granularity == "full" and cfg.trainer.offload_during_rollout
        assert plan.memory.trainer_offload == "trainer.offload_during_rollout"


def test_qwen_shapes_match_published_parameter_counts():
    expected = {"qwen2.5-7b": 7.62e9, "qwen2.5-14b": 14.77e9, "qwen2.5-32b": 32.76e9}
    for key, count in expected.items():
        assert BUILTIN_SHAPES[key].total_params == pytest.approx(count, rel=0.002)
    assert BUILTIN_SHAPES["qwen2.5-7b"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_memory_hand_computed_7b():
    cfg = load_config(REPO / "examples/qwen2.5/qwen2.5_7b_math_2x8_tp2_rtp1.yaml")
    shape = BUILTIN_SHAPES["qwen2.5-7b"]
    est = estimate_memory(cfg, shape, GPUS["h800"])
    params = (28 * shape.layer_params + 2 * 152064 * 3584) // 2
    assert trainer_params_per_gpu(cfg, shape) == params
    assert est.trainer["weights"] == pytest.approx(params * 2 / GIB)
    assert est.trainer["gradients"] == pytest.approx(params * 4 / GIB)
    assert est.trainer["optimizer"] == pytest.approx(params * 12 / 8 / GIB)  # sharded over DP=8
    assert est.engine["weights"] == pytest.approx(shape.total_params * 2 / GIB)
    kv = 0.55 * 80 - shape.total_params * 2 / GIB - 2.0
    assert est.kv_tokens_per_engine == int(kv * GIB / (2 * 28 * 4 * 128 * 2))


def test_32b_layout_without_recompute_and_offload_is_refused_with_the_reason():
    cfg = load_config(RECIPE_32B, ["parallel.recompute_granularity=none", "trainer.offload_during_rollout=false"])
    with pytest.raises(PlanError, match=r"rollout phase needs 9\d\.\d GiB per GPU > 80 GiB") as info:
        make_plan(cfg)
    message = str(info.value)
    assert "train phase needs" in message and "parallel.tensor_model_parallel_size" in message
    assert "parallel.recompute_granularity=full" in message and "trainer.offload_during_rollout=true" in message
    assert "parallel.use_distributed_optimizer=true" not in message  # already set: not advised


def test_recompute_lowers_activations_as_computed_by_hand():
    shape = BUILTIN_SHAPES["qwen2.5-32b"]
    h, ffn, kv, heads, layers = 5120, 27648, 8 * 128, 40, 64
    tp, tokens = 8, 33792  # TP8, no CP: the whole microbatch on every rank, sequence parallel on
    # bf16 q/k/v, attention out, fc1 (gate+up), SwiGLU out split by TP; fp32 log-sum-exp per head
    # (flash attention's only internal state); six hidden-size tensors split by SP.
    per_layer = 2 * ((h + 2 * kv) + h + 2 * ffn + ffn) / tp + 4 * heads / tp + 2 * 6 * h / tp
    expected = {
        "none": tokens * layers * per_layer,
        "selective": tokens * layers * (per_layer - 4 * heads / tp),
        # every layer's bf16 input (split by SP) + one layer recomputed in the backward
        "full": tokens * (layers * 2 * h / tp + per_layer),
    }
    for granularity, value in expected.items():
        cfg = load_config(RECIPE_32B, [f"parallel.recompute_granularity={granularity}"])
        est = estimate_memory(cfg, shape, GPUS["h800"])
        assert est.trainer["activations"] == pytest.approx(value / GIB, rel=1e-12), granularity
        assert est.recompute == granularity
    assert expected["full"] / GIB == pytest.approx(3.57, abs=0.01)
    assert expected["none"] / GIB == pytest.approx(63.46, abs=0.05)
    assert expected["none"] - expected["selective"] == tokens * layers * 20  # 20 B/token/layer: ~0.06 %
    # Without sequence parallelism the stored layer inputs are full-size on every TP rank.
    no_sp = tokens * (layers * 2 * h + per_layer + 2 * 6 * h * (1 - 1 / tp))
    cfg = load_config(RECIPE_32B, ["parallel.sequence_parallel=false"])
    assert estimate_memory(cfg, shape, GPUS["h800"]).trainer["activations"] == pytest.approx(no_sp / GIB, rel=1e-12)


def test_offload_lowers_the_rollout_peak_by_the_trainer_state():
    shape = BUILTIN_SHAPES["qwen2.5-32b"]
    kept = estimate_memory(load_config(RECIPE_32B, ["trainer.offload_during_rollout=false"]), shape, GPUS["h800"])
    off = estimate_memory(load_config(RECIPE_32B), shape, GPUS["h800"])
    t = kept.trainer
    assert kept.rollout_peak_gib - off.rollout_peak_gib == pytest.approx(t["weights"] + t["gradients"] + t["optimizer"])
    assert off.rollout_trainer_gib == 0.0 and kept.rollout_trainer_gib == pytest.approx(28.6, abs=0.05)
    assert off.train_peak_gib == kept.train_peak_gib  # everything is back for training
    # A reference model's weights leave the GPU too.
    ref_kept, ref_off = (estimate_memory(load_config(RECIPE_32B, [f"trainer.offload_during_rollout={flag}",
                                                                  "model.use_reference_model=true"]),
                                         shape, GPUS["h800"]) for flag in ("false", "true"))
    gone = sum(ref_kept.trainer[k] for k in ("weights", "gradients", "optimizer", "reference weights"))
    assert ref_kept.rollout_peak_gib - ref_off.rollout_peak_gib == pytest.approx(gone)
    # The what-if flag forces it on for a recipe without it, and says so.
    forced = estimate_memory(load_config(RECIPE_32B, ["trainer.offload_during_rollout=false"]), shape, GPUS["h800"],
                             MemoryAssumptions(trainer_offload_during_rollout=True))
    assert forced.rollout_peak_gib == off.rollout_peak_gib and forced.trainer_offload == "assumed"
    assumes = format_memory(off, MemoryAssumptions())[-1]
    assert "trainer offloaded during rollout = True (trainer.offload_during_rollout)" in assumes
    assert "activation recomputation = full" in assumes


def test_placement_coordinates_and_node_boundaries():
    cfg = load_config(REPO / "examples/qwen2.5/qwen2.5_14b_math_4x8_tp4_rtp2.yaml")
    nodes = plan_placement(cfg, ["a", "b", "c", "d"])
    assert nodes[1].gpus[0].trainer_rank == 8 and nodes[1].gpus[0].coords == "tp0 cp0 dp2 pp0"
    assert nodes[2].gpus[0].coords == "tp0 cp0 dp4 pp0"
    assert nodes[0].gpus[3].coords == "tp3 cp0 dp0 pp0"
    assert [s.engine for s in nodes[3].gpus] == [12, 12, 13, 13, 14, 14, 15, 15]
    assert sum(len(n.reward_workers) for n in nodes) == cfg.reward.num_workers
    cfg.rollout.tensor_parallel_size = 3
    with pytest.raises(PlanError, match="must not cross a node"):
        plan_placement(cfg)
    with pytest.raises(PlanError, match="lists 2 hosts"):
        plan_placement(load_config(REPO / "examples/qwen2.5/qwen2.5_7b_math_2x8_tp2_rtp1.yaml",
                                   ["cluster.num_nodes=4"]), ["a", "b"])


def test_shape_from_config_json_and_unknown_name(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 320, "hidden_size": 128, "intermediate_size": 256,
                                               "num_hidden_layers": 2, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "max_position_embeddings": 1024}))
    assert resolve_shape(str(d)).arch.num_layers == 2
    assert resolve_shape("/nowhere/Qwen2.5-14B-Instruct").name == "Qwen2.5-14B"
    with pytest.raises(ConfigError, match="model.hf_path"):
        resolve_shape("/nowhere/llama-7b")


def test_plan_cli_exit_codes(capsys):
    from rollpacker.benchmarks.plan_cluster import main

    recipe = str(REPO / "examples/qwen2.5/qwen2.5_7b_math_2x8_tp2_rtp1.yaml")
    assert main(["--config", recipe]) == 0
    assert "plan: OK" in capsys.readouterr().out
    assert main(["--config", recipe, "rollout.gpu_memory_utilization=0.9"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["--config", recipe, "--assume-trainer-offload", "rollout.gpu_memory_utilization=0.9"]) == 0
    assert "trainer offloaded during rollout = True (assumed)" in capsys.readouterr().out

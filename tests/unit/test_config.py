"""Config loading, overrides and up-front validation: every error names its key."""
from pathlib import Path

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.schema import RunConfig, register_section
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError
from rollpacker.config import PlannerConfig, StreamConfig, TailBatchingConfig, parse_initial_tp
from rollpacker.peers.config import PeersConfig

REPO = Path(__file__).resolve().parents[2]
TINY_ARCH = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "max_position_embeddings": 1024}


def test_recipe_loads_and_overrides_apply():
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu.yaml", ["trainer.steps=5", "rollout.temperature=0.7",
                                                               "trainer.run_dir=/tmp/x", "trainer.resume=true"])
    assert cfg.trainer.steps == 5
    assert cfg.rollout.temperature == 0.7
    assert cfg.trainer.run_dir == "/tmp/x"
    assert cfg.trainer.resume is True
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.data_parallel_size) == (1, 2)
    validate(cfg, TINY_ARCH, device="cpu")



def test_a_plugin_section_is_read_typed_as_its_dataclass_and_is_the_object_the_yaml_keys_set():
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu_full.yaml", ["tail_batching.eta_prompts=1.5",
                                                                    "peers.partial.max_continuations=3"])
    tb = cfg.section(TailBatchingConfig)
    assert isinstance(tb, TailBatchingConfig) and tb is cfg.tail_batching and tb.eta_prompts == 1.5
    assert cfg.section(PeersConfig).partial.max_continuations == 3
    assert cfg.section(StreamConfig) is cfg.stream and cfg.section(PlannerConfig) is cfg.planner
    # A config built in code: the section is made on first use, typed the same way.
    assert cfg.section(TailBatchingConfig) is not RunConfig().section(TailBatchingConfig)


def test_a_section_read_typed_fails_naming_what_is_wrong():
    class Unregistered:
        pass

    with pytest.raises(AttributeError, match="no config section is registered with .*Unregistered"):
        RunConfig().section(Unregistered)
    cfg = RunConfig()
    cfg.extensions["tail_batching"] = {"eta_prompts": 2.0}  # e.g. a section set by hand to a dict
    with pytest.raises(TypeError, match="'tail_batching' holds a dict, not a TailBatchingConfig"):
        cfg.section(TailBatchingConfig)
    with pytest.raises(ValueError, match="would hide RunConfig.section"):
        register_section("section", Unregistered, "a name taken by a RunConfig method")

def test_the_full_cpu_recipe_turns_every_mechanism_on_and_validates():
    """examples/qwen2.5/tiny_cpu_full.yaml (CONFIG= of launch/local.sh): tail batching, the planner with a
    TP switch between round types, the stream trainer releasing one of its two engines, speculation of the
    long rounds, history routing, trainer offload and engine sleep; it loads and validates up front."""
    cfg = load_config(REPO / "examples/qwen2.5/tiny_cpu_full.yaml", ["trainer.steps=5"])
    validate(cfg, TINY_ARCH, device="cpu")
    assert cfg.scheduler.name == "tail_batching" and cfg.tail_batching.history_routing
    assert cfg.rollout.num_engines == 2 and cfg.rollout.tensor_parallel_size == 1
    assert cfg.planner.enabled and (cfg.planner.growth, cfg.planner.quiet_rounds) == (1.05, 4)
    assert len(set(parse_initial_tp(cfg.planner.initial_tp).values())) == 2  # the round types differ: a switch
    st = cfg.stream
    assert st.enabled and st.rounds == "long" and (st.start_fraction_min, st.start_fraction_max) == (0.2, 0.5)
    assert 0 < st.release_engines < cfg.rollout.num_engines
    assert cfg.rollout.speculative.method == "suffix" and cfg.rollout.speculative.rounds == "long"
    assert cfg.trainer.offload_during_rollout and cfg.rollout.sleep_during_train
    assert cfg.trainer.steps == 5


def test_every_recipe_has_its_own_run_dir():
    # Two recipes sharing a run_dir would resume from (and overwrite) each other's checkpoints.
    recipes = sorted((REPO / "examples").rglob("*.yaml"))
    run_dirs = {path.name: load_config(path, []).trainer.run_dir for path in recipes}
    assert len(recipes) >= 10
    assert len(set(run_dirs.values())) == len(run_dirs), run_dirs


@pytest.mark.parametrize("override, key", [
    ("trainer.stepz=3", "trainer.stepz"),
    ("nosection.x=1", "nosection"),
    ("trainer.steps=abc", "trainer.steps"),
    ("trainer.steps=1.5", "trainer.steps"),
    ("trainer.resume=maybe", "trainer.resume"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_yaml_key_names_file_and_key(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("trainer:\n  steps: 3\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"trainer\.lr.*r\.yaml"):
        load_config(f)


def test_wrong_type_in_yaml(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("data:\n  prompts_per_step: eight\n")
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step"):
        load_config(f)


@pytest.mark.parametrize("overrides, key", [
    (["parallel.tensor_model_parallel_size=3"], "tensor_model_parallel_size"),
    (["parallel.tensor_model_parallel_size=4"], "KV groups"),
    (["parallel.pipeline_model_parallel_size=3"], "pipeline_model_parallel_size"),
    (["rollout.max_new_tokens=2000"], "max_position_embeddings"),
])
def test_impossible_layout_against_architecture(overrides, key):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=key):
        validate(cfg, TINY_ARCH, device="cpu")


@pytest.mark.parametrize("overrides, key", [
    (["parallel.context_parallel_size=2"], "context_parallel_size"),
    (["parallel.sequence_parallel=true"], "sequence_parallel"),
    (["parallel.use_distributed_optimizer=true"], "parallel.use_distributed_optimizer"),
    (["rollout.weight_sync_format=nccl"], "rollout.weight_sync_format"),
    (["rollout.weight_push_channel=ipc"], "rollout.weight_push_channel"),
    (["rollout.weight_push_buffers=0"], "rollout.weight_push_buffers"),
    (["rollout.weight_push_bucket_mb=0"], "rollout.weight_push_bucket_mb"),
    (["model.dtype=bfloat16"], "model.dtype"),
    (["algorithm.loss_agg=mean"], "algorithm.loss_agg"),
    (["algorithm.recompute_old_logprobs=false", "algorithm.ppo_mini_batches=2"], "algorithm.recompute_old_logprobs"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.cpu_engine_start=forkserver"], "rollout.cpu_engine_start"),
    (["data.prompts_per_step=0"], "data.prompts_per_step"),
    (["data.format=custom"], "data.prompt_key"),
    (["parallel.data_parallel_size=8", "cluster.num_cpus=2"], "cluster.num_cpus"),
])
def test_cpu_refusals(overrides, key):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, device="cpu")


def test_gpu_count_checked():
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=4", "parallel.data_parallel_size=4",
                             "cluster.gpus_per_node=8", "cluster.num_nodes=1"])
    with pytest.raises(ConfigError, match="exceeds"):
        validate(cfg, device="cuda")
    cfg.cluster.num_nodes = 2
    validate(cfg, device="cuda")


def test_split_placement_needs_two_nodes_and_room_for_the_ranks():
    cfg = load_config(None, ["cluster.placement=split", "cluster.num_nodes=1"])
    with pytest.raises(ConfigError, match="cluster.num_nodes >= 2"):
        validate(cfg, device="cpu")
    cfg = load_config(None, ["cluster.placement=split", "cluster.num_nodes=2", "cluster.gpus_per_node=2",
                             "parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2"])
    with pytest.raises(ConfigError, match="trainer world size 4 exceeds its 2 GPUs"):
        validate(cfg, device="cuda")
    cfg = load_config(None, ["cluster.placement=spread"])
    with pytest.raises(ConfigError, match="cluster.placement"):
        validate(cfg, device="cpu")
    validate(load_config("examples/qwen2.5/tiny_cpu_2node.yaml", []), device="cpu")


def test_context_parallelism_is_refused_on_gpus_too_naming_the_key_and_why():
    cfg = load_config(None, ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"parallel.context_parallel_size=2: context parallelism is not supported "
                                          r"\(Megatron-Core CP needs Transformer Engine's context-parallel attention"):
        validate(cfg, device="cuda")
    with pytest.raises(ConfigError, match="rollout.sleep_level"):
        validate(load_config(None, ["rollout.sleep_level=3"]), device="cuda")


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import megatron_rl.config as mod

    tree = ast.parse(inspect.getsource(mod))
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                            and isinstance(nxt.value.value, str)):
                        missing.append(f"{node.name}.{stmt.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


def test_defaults_are_valid():
    validate(RunConfig(), TINY_ARCH, device="cpu")


def test_exponent_floats_without_dot(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("optimizer:\n  lr: 1e-5\n")
    assert load_config(f).optimizer.lr == 1e-5
    assert load_config(None, ["optimizer.lr=3e-4"]).optimizer.lr == 3e-4
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        load_config(None, ["optimizer.lr=fast"])


CONFIG_PAGE = REPO / "docs/configuration.md"


def test_config_reference_page_is_current():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "megatron_rl.tools.config_reference", "--check", str(CONFIG_PAGE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_config_reference_check_fails_on_a_stale_page_and_write_repairs_it(tmp_path, capsys):
    from megatron_rl.tools import config_reference

    page = CONFIG_PAGE.read_text()
    row = "* `trainer.steps` ("
    assert row in page
    stale = tmp_path / "configuration.md"
    stale.write_text(page.replace(row, "* `trainer.steps_renamed` (", 1))  # a key the code no longer has
    assert config_reference.main(["--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert config_reference.main(["--write", str(stale)]) == 0
    assert stale.read_text() == page  # only the block changed: the text around it is kept
    assert config_reference.main(["--check", str(stale)]) == 0
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("# no reference here\n")
    assert config_reference.main(["--check", str(unmarked)]) == 1


def test_old_logprob_pass_is_skipped_by_default_only_with_one_optimizer_step(tmp_path):
    from megatron_rl.config.loading import apply_override, load_config

    cfg = load_config(None)
    assert cfg.algorithm.recompute_old_logprobs is None and not cfg.algorithm.recomputes_old_logprobs()
    apply_override(cfg, "algorithm.ppo_mini_batches=2")
    assert cfg.algorithm.recomputes_old_logprobs()  # several optimizer steps: the old policy must be scored
    for text, want in (("true", True), ("false", False), ("null", None)):
        apply_override(cfg, f"algorithm.recompute_old_logprobs={text}")
        assert cfg.algorithm.recompute_old_logprobs is want
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  recompute_old_logprobs: true\n")
    assert load_config(recipe).algorithm.recomputes_old_logprobs()
    recipe.write_text("algorithm:\n  recompute_old_logprobs: 3\n")
    with pytest.raises(ConfigError, match="algorithm.recompute_old_logprobs"):
        load_config(recipe)

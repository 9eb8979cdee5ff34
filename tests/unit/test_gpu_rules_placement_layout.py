"""The GPU layout rule (megatron_rl/distributed/gpu_layout.py) and the Ray options RunPlacement derives
from it, without Ray: bad layouts fail naming the key; every elastic TP size keeps each engine on one
node and the rollout GPUs unchanged; a TP-k engine names its k bundles for vLLM's Ray executor.
The placement on a Ray cluster is tests/integration/test_gpu_rules_placement.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.distributed.cluster import RunPlacement, at_rollout_tp
from megatron_rl.distributed.gpu_layout import LayoutError, gpu_layout, run_layout

RECIPE_32B = Path(__file__).resolve().parents[2] / "examples/qwen2.5/qwen2.5_32b_math_8x8_tp8_rtp2.yaml"


@pytest.mark.parametrize("args, key", [
    ((16, 16, 3, 2, 8, False), "rollout.tensor_parallel_size=3"),
    ((17, 16, 1, 2, 8, False), "trainer world size 17"),
    ((8, 9, 2, 2, 8, False), "9 engines"),
    ((9, 8, 1, 2, 8, True), "cluster.placement 'split'"),
    ((8, 9, 1, 2, 8, True), "the nodes other than the driver's has 8"),
    ((8, 1, 1, 1, 8, True), "cluster.num_nodes >= 2"),
])
def test_bad_layouts_fail_naming_the_key(args, key):
    with pytest.raises(LayoutError, match=key.replace("(", r"\(")):
        gpu_layout(*args)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_elastic_tp_keeps_engines_on_one_node_and_the_same_rollout_gpus(tp):
    cfg = load_config(RECIPE_32B, ["cluster.device=cuda"])
    base = run_layout(cfg)
    layout = run_layout(at_rollout_tp(cfg, tp))
    assert sorted(layout.rollout_gpus) == sorted(base.rollout_gpus) == list(range(64))
    for gpus in layout.engine_gpus:
        assert len(gpus) == tp and len({layout.node_of(g) for g in gpus}) == 1
    assert sorted(layout.trainer_gpus) == list(range(64)) and layout.node_of(layout.trainer_gpus[0]) == 0
    with pytest.raises(ValueError, match="rollout TP 3"):
        at_rollout_tp(cfg, 3)


class _Bundles(SimpleNamespace):
    def strategy(self, position, capture_children=False):
        return ("bundle", self.bundle[position], capture_children)


def test_run_placement_options_share_each_gpu_and_name_a_tp_engine_bundles():
    cfg = load_config(RECIPE_32B, ["cluster.device=cuda"])
    order = list(reversed(range(64)))  # Ray's bundle numbering differs from the sorted order
    placed = RunPlacement(cfg, "cuda", _Bundles(bundle=order, ip=[f"10.0.0.{g // 8}" for g in range(64)]))
    ranks, engines = placed.all_trainer_options(), placed.engine_options()
    assert [r["scheduling_strategy"][1] for r in ranks] == order and {r["num_gpus"] for r in ranks} == {0.5}
    assert engines[3]["num_gpus"] == 0 and engines[3]["scheduling_strategy"] == ("bundle", order[6], True)
    assert engines[3]["runtime_env"]["env_vars"] == {"VLLM_RAY_BUNDLE_INDICES": f"{order[6]},{order[7]}",
                                                     "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    assert placed.master_addr() == "10.0.0.0"
    one = placed.engine_options(at_rollout_tp(cfg, 1))
    assert len(one) == 64 and one[5]["num_gpus"] == 0.5 and one[5]["scheduling_strategy"][1] == order[5]
    # CPU runs: the plain options, no GPU.
    cpu = RunPlacement(load_config(RECIPE_32B, ["cluster.device=cpu"]), "cpu")
    assert cpu.trainer_options(0)["num_gpus"] == 0 and cpu.engine_options()[0]["num_gpus"] == 0


@pytest.mark.parametrize("rollout", [("2", "1"), ("1", "2"), ("4", "1")])
def test_a_local_cpu_cluster_fits_the_engines_of_every_rollout_tp(rollout, monkeypatch):
    """A local CPU run's Ray cluster (``cluster._needed_cpus`` logical CPUs) holds every trainer rank, the
    reward workers and the engines of any TP a switch may start (``at_rollout_tp``): a run started as one
    TP-2 engine whose long rounds run two TP-1 engines once waited 600 s for an engine actor Ray could not
    place. The machine's own core count is kept out (a large machine would hide the shortfall)."""
    from megatron_rl.distributed import cluster

    tp, engines = rollout
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2", f"rollout.tensor_parallel_size={tp}",
                             f"rollout.num_engines={engines}", "cluster.device=cpu"])
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 1)
    placement = RunPlacement(cfg, "cpu")
    ranks = sum(o["num_cpus"] for o in placement.all_trainer_options())
    rewards = cfg.reward.num_workers * cfg.reward.worker_num_cpus
    devices = int(tp) * int(engines)
    for switch_tp in (t for t in (1, 2, 4) if devices % t == 0):
        engine_cpus = sum(o["num_cpus"] for o in placement.engine_options(at_rollout_tp(cfg, switch_tp)))
        assert ranks + engine_cpus + rewards <= cluster._needed_cpus(cfg, "cpu"), switch_tp

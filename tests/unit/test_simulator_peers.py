"""The simulator's peers (rollpacker/simulator/peer_policies.py) keep the invariants of the schedulers they
model, and docs/results/simulated_peers.json is what `rollpacker-simulate-peers` computes now."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from rollpacker.benchmarks import simulate_peers
from rollpacker.simulator import peer_policies as peers
from rollpacker.simulator.costs import RewardModel
from rollpacker.simulator.lengths import EmpiricalLengths, LogNormalLengths
from rollpacker.simulator.policies import Features
from rollpacker.simulator.runner import run_policy
from tests.helpers.simulator_cluster import small_cluster

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "docs" / "results" / "simulated_peers.json"


def heavy_tail():
    """16 prompts x 4 responses on 4 engines, lengths with a long tail, rewards that take no time."""
    cl = small_cluster(LogNormalLengths(60, 0.9, 0.5, 600, 32))
    return replace(cl, reward=RewardModel(10_000, median_s=1e-6, sigma=0.0))


def per_prompt_lengths(seed=0, prompts=200):
    """Each prompt's responses all have one length (so a policy's draws do not change them), varying by prompt."""
    rng = random.Random(seed)
    groups = [[min(600, int(30 * rng.lognormvariate(0, 1)) + 1)] for _ in range(prompts)]
    cl = small_cluster(EmpiricalLengths(groups, 600, 32, sequential=True))
    return replace(cl, reward=RewardModel(10_000, median_s=1e-6, sigma=0.0))


def off_policy(steps):
    tokens = sum(s.trained_tokens for s in steps)
    return sum(s.stale_tokens for s in steps) / tokens, sum(s.lag_tokens for s in steps) / tokens


@pytest.mark.parametrize("split", [None, peers.Split(3, 1)])
def test_one_step_off_trains_every_token_one_version_old(split):
    steps = peers.one_step_off(heavy_tail(), 12, seed=1, split=split)
    assert steps[0].stale_tokens == 0 and steps[0].max_staleness == 0  # step 0 generates its own batch
    assert off_policy(steps[1:]) == (1.0, 1.0)
    assert {s.max_staleness for s in steps[1:]} == {1}
    assert all(s.step_s > 0 and s.wasted_tokens == 0 for s in steps)


def test_colocated_one_step_off_hides_only_what_sharing_allows():
    cl = heavy_tail()
    sliced = peers.one_step_off(cl, 12, seed=1)
    hidden = peers.one_step_off(cl, 12, seed=1, overlap=1.0)
    base = run_policy(cl, Features(), 13, 1, "baseline").steps
    # Time-slicing: rollout + train per step, as the baseline (whose rewards take no time here).
    for n in range(1, 12):
        assert sliced[n].step_s == pytest.approx(base[n + 1].rollout_s + base[n].train_s + base[n].sync_s, rel=1e-6)
        assert hidden[n].step_s < sliced[n].step_s


def test_async_with_k0_is_the_synchronous_baseline_on_its_gpus():
    cl, split = per_prompt_lengths(), peers.Split(3, 1)
    steps = peers.async_rollout(cl, split, 0, 10, seed=0)
    base = run_policy(peers.on_split(cl, split), Features(), 10, 0, "baseline").steps
    assert [s.step_s for s in steps] == pytest.approx([b.step_s for b in base], rel=1e-3)
    assert sum(s.stale_tokens + s.wasted_tokens for s in steps) == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_keeps_every_token_within_k_versions(k):
    steps = peers.async_rollout(heavy_tail(), peers.Split(3, 1), k, 20, seed=2)
    assert max(s.max_staleness for s in steps) == k  # reached, never exceeded
    assert 0 < off_policy(steps[k + 1:])[0] <= 1
    assert all(s.step_s > 0 and s.wasted_tokens >= 0 for s in steps)


@pytest.mark.parametrize("bound", [1, 2])
def test_partial_rollout_wastes_nothing_and_keeps_its_bound(bound):
    steps = peers.partial_rollout(heavy_tail(), 20, seed=3, over_provision=1.5, max_continuations=bound)
    assert all(s.wasted_tokens == 0 and s.step_s > 0 for s in steps)
    assert max(s.max_staleness for s in steps) == bound  # carried groups are trained, due ones first
    assert 0 < off_policy(steps[3:])[0] < 1  # continued responses mix versions


def test_with_equal_lengths_the_schedulers_tie():
    cl = heavy_tail()
    cl = replace(cl, lengths=replace(cl.lengths, sigma_prompt=0.0, sigma_response=0.0))
    base = run_policy(cl, Features(), 10, 0, "baseline").mean_step_s
    warm = 2
    for steps in (peers.partial_rollout(cl, 12, 0, 1.25, 2), peers.one_step_off(cl, 12, 0)):
        mean = sum(s.step_s for s in steps[warm:]) / len(steps[warm:])
        assert mean == pytest.approx(base, rel=0.02)


def test_bad_settings_fail_naming_them():
    cl = heavy_tail()
    with pytest.raises(ValueError, match="over_provision"):
        peers.partial_rollout(cl, 2, 0, over_provision=2.5)
    with pytest.raises(ValueError, match="staleness k"):
        peers.async_rollout(cl, peers.Split(3, 1), -1, 2, 0)
    with pytest.raises(ValueError, match="exceeds"):
        peers.on_split(cl, peers.Split(4, 1))
    assert simulate_peers.main(["--seeds", "0"]) == 2
    assert simulate_peers.main(["--recipe", simulate_peers.RECIPES[0], "--split", "16+8"]) == 2


def test_the_recorded_table_is_what_the_command_computes_now():
    """Recomputes the two cheapest rows of the 7B recipe at the recorded settings: a change of the
    simulator's constants fails here until `rollpacker-simulate-peers --record docs/results/simulated_peers.json`."""
    data = json.loads(RECORD.read_text())
    raw = data["settings"]
    settings = simulate_peers.Settings(**raw)
    recipe = simulate_peers.load_recipe(data["recipes"][0], settings, split=peers.Split(*data["splits"][0]))
    seed = settings.seeds[0]
    runs = data["runs"][f"seed {seed}"]
    base = None
    for key in ("7b/baseline", "7b/one_step_off"):
        row = simulate_peers.simulate_row(recipe, key, settings, seed)
        base = base or row["step_s"]
        row.update(speedup=base / row["step_s"], wasted_k=row.pop("wasted") / 1e3)
        for name, col, _ in simulate_peers.COLUMNS:
            assert runs[name][key] == round(row[col], 4), (key, name)
    names = [key for key, _ in simulate_peers.row_names(recipe, settings)]
    assert [row["key"] for row in data["rows"]][: len(names)] == names


def test_the_command_records_a_results_file(tmp_path: Path, capsys):
    out = tmp_path / "peers.json"
    assert simulate_peers.main(["--recipe", simulate_peers.RECIPES[0], "--steps", "2", "--warmup", "1", "--seeds", "1",
                                "--ks", "1", "--split", "12+4", "--record", str(out)]) == 0
    data = json.loads(out.read_text())
    titles = [row["title"] for row in data["rows"]]
    assert titles[:3] == ["7B synchronous baseline", "7B tail batching alone", "7B RollPacker (the recipe's mechanisms)"]
    assert data["runs"]["seed 0"]["speedup"]["7b/baseline"] == 1.0
    assert data["source"] == "computed" and data["settings"]["ks"] == [1]
    assert "| 7B async k=1, split 12+4 |" in capsys.readouterr().out
    assert data["splits"] == [[12, 4]]

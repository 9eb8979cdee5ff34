"""Elastic rollout TP: legal sizes, the profile-based start and the paper's online rule."""
import pytest

from megatron_rl.model.qwen2 import Qwen2Arch
from rollpacker.planner import ElasticTPPlanner, legal_tp_sizes
from rollpacker.tp_profile import fastest_tp


def arch(heads=8, kv=4, vocab=320, layers=2) -> Qwen2Arch:
    return Qwen2Arch(vocab_size=vocab, hidden_size=32 * heads, intermediate_size=512, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, max_position_embeddings=256, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=True)


def test_legal_sizes_respect_node_gpus_heads_and_vocab():
    assert legal_tp_sizes(arch(), gpus_per_node=8, num_gpus=16) == [1, 2, 4, 8]
    assert legal_tp_sizes(arch(), gpus_per_node=4, num_gpus=16) == [1, 2, 4]  # never crosses a node
    assert legal_tp_sizes(arch(), gpus_per_node=8, num_gpus=6) == [1, 2]  # must divide the GPU count
    assert legal_tp_sizes(arch(heads=12, kv=12), gpus_per_node=8, num_gpus=8) == [1, 2, 4]  # 12 % 8 != 0
    assert legal_tp_sizes(arch(), gpus_per_node=8, num_gpus=8, max_tp=2) == [1, 2]
    # Qwen2.5-7B: 28 heads, 4 KV heads, vocab 152064 -> TP 8 illegal (28 % 8).
    assert legal_tp_sizes(arch(heads=28, kv=4, vocab=152064), 8, 16) == [1, 2, 4]


def test_preemption_rise_doubles_and_quiet_rounds_halve():
    p = ElasticTPPlanner(sizes=[1, 2, 4, 8], initial={"short": 2})
    assert p.tp_for("short") == 2 and p.tp_for("long") == 1
    assert p.observe("short", 100).reason == "keep"  # first round only sets the baseline
    assert p.observe("short", 105).reason == "keep"  # exactly 1.05x is not "more than"
    d = p.observe("short", 111)
    assert (d.old_tp, d.new_tp, d.reason, d.changed) == (2, 4, "grow", True)
    assert p.observe("short", 500).new_tp == 4  # new baseline after a switch
    for _ in range(3):
        assert p.observe("short", 0).new_tp == 4
    d = p.observe("short", 0)  # fourth quiet round
    assert (d.new_tp, d.reason) == (2, "shrink")
    assert p.tp_for("long") == 1  # round types are independent


def test_rise_from_zero_grows_and_bounds_hold():
    p = ElasticTPPlanner(sizes=[1, 2])
    p.observe("long", 0)
    assert p.observe("long", 3).new_tp == 2
    p.observe("long", 10)
    assert p.observe("long", 1000).new_tp == 2  # already the largest legal size
    q = ElasticTPPlanner(sizes=[1, 2], quiet_rounds=2)
    q.observe("s", 0)
    assert q.observe("s", 0).new_tp == 1  # already the smallest


def test_profile_picks_fastest_legal_tp_and_state_round_trips():
    p = ElasticTPPlanner(sizes=[1, 2, 4], initial=fastest_tp({"short": {1: 30.0, 2: 22.5, 4: 25.0, 8: 1.0},
                                                              "long": {1: 50.0, 2: 60.0}}, [1, 2, 4]))
    assert p.initial == {"short": 2, "long": 1}
    p.observe("short", 7)
    state = p.state_dict()
    q = ElasticTPPlanner(sizes=[1, 2, 4])
    q.load_state_dict(state)
    assert q.observe("short", 8).new_tp == 4  # 8 > 1.05 * 7 against the restored baseline
    small = ElasticTPPlanner(sizes=[1])  # fewer GPUs after restart: falls back
    small.load_state_dict(state)
    assert small.tp_for("short") == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="initial TP 3"):
        ElasticTPPlanner(sizes=[1, 2], initial={"short": 3})
    with pytest.raises(ValueError, match="no legal TP"):
        fastest_tp({"short": {8: 1.0}}, [1, 2])
    with pytest.raises(ValueError, match="preemptions"):
        ElasticTPPlanner(sizes=[1]).observe("s", -1)

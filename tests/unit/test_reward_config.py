"""Validation of the reward-scheduler keys of RewardConfig (each error names its key)."""
import pytest

from megatron_rl.config.loading import load_config
from megatron_rl.config.validation import validate
from megatron_rl.config.values import ConfigError


@pytest.mark.parametrize("overrides, key", [
    (["reward.kind=regex"], "reward.kind"),
    (["reward.kind=judge"], "reward.judge_model"),
    (["reward.sandbox_isolation=chroot"], "reward.sandbox_isolation"),
    (["reward.num_workers=4", "reward.max_workers=2"], "reward.num_workers"),
    (["reward.num_workers=1", "reward.min_workers=2", "reward.max_workers=3"], "reward.num_workers"),
    (["reward.code_timeout_min_s=5", "reward.code_timeout_max_s=2"], "reward.code_timeout_max_s"),
    (["reward.code_timeout_scale=0"], "reward.code_timeout_scale"),
])
def test_bad_reward_settings_name_their_key(overrides, key):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, device="cpu")


def test_reward_scheduler_settings_accepted():
    cfg = load_config(None, ["reward.kind=mixed", "reward.num_workers=2", "reward.min_workers=1",
                             "reward.max_workers=4", "reward.sandbox_isolation=audit",
                             "cluster.num_cpus=4"])
    validate(cfg, device="cpu")
    assert (cfg.reward.min_workers, cfg.reward.max_workers) == (1, 4)
    judge = load_config(None, ["reward.kind=judge", "reward.judge_model=/models/judge"])
    validate(judge, device="cpu")

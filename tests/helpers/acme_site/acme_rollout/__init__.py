"""A third-party plug-in package for megatron_rl, not RollPacker: what a user's own package does to
add a scheduler with a config section of its own (tests/unit/test_plugin_packages.py).

Its distribution (``acme_rollout-0.1.dist-info`` beside it: this directory stands for a site
directory it was installed into) names this module in the ``megatron_rl.plugins`` entry-point
group, so the trainer imports it before parsing a config: ``acme.partial.max_continuations=2``
on the command line parses like a core key and ``scheduler.name=acme`` is a registered name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.plugins import register_scheduler
from megatron_rl.config.schema import RunConfig, register_section
from megatron_rl.config.validation import register_validator
from megatron_rl.config.values import ConfigError
from megatron_rl.loop.baseline import BaselineScheduler


@dataclass
class AcmePartialConfig:
    max_continuations: int = 1
    """Steps a response may be carried: the scheduler's staleness bound."""


@dataclass
class AcmeConfig:
    partial: AcmePartialConfig = field(default_factory=AcmePartialConfig)
    """Acme's partial-rollout settings."""


class AcmeScheduler(BaselineScheduler):
    """The baseline's rollout, declaring the bound its own section sets."""

    name = "acme"

    def max_staleness(self, cfg: RunConfig) -> int:
        return cfg.acme.partial.max_continuations


def validate_acme(cfg: RunConfig) -> None:
    if cfg.acme.partial.max_continuations < 0:
        raise ConfigError(f"acme.partial.max_continuations: must be >= 0, got {cfg.acme.partial.max_continuations}")


register_section("acme", AcmeConfig, "Acme's rollout scheduler (a third-party plug-in).")
register_validator(validate_acme)
register_scheduler("acme", "acme_rollout:AcmeScheduler")

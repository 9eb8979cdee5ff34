"""The ``peers`` config section: the settings of the schedulers tail batching is measured against.

Importing this module registers the section (``peers.partial.*``, ``peers.one_step_off.*``), so
code that reads it typed (``cfg.section(PeersConfig)``) finds it whether or not the entry points
were loaded. The checks of the values live beside the schedulers that read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.schema import register_section


@dataclass
class PartialRolloutConfig:
    over_provision: float = 1.25
    """Groups in flight per step: ceil(over_provision x P0), the carried ones first, then fresh
    prompts; the first P0 to complete form the batch and the rest are aborted and carried. In
    [1, 2]; 1 means no over-provisioning (nothing is ever aborted)."""
    max_continuations: int = 2
    """Most steps a group may be carried before it is trained: the staleness bound the scheduler
    declares (no token is older than this many policy versions). A group carried this often is
    finished in its next step, whatever it takes. >= 1."""
    drop_on_resume: bool = False
    """A resumed run drops the carried responses (counted as rollout/partial/dropped_* and
    wasted tokens) and generates their prompts again, instead of continuing them."""


@dataclass
class OneStepOffConfig:
    max_staleness: int = 1
    """Steps the rollout runs ahead of training, which is the staleness bound the scheduler
    declares: 1 is veRL's one-step-off (step t+1's batch is generated while step t trains); k > 1
    generates step t+k's batch during step t, so up to k batches wait, generated and scored. >= 1."""


@dataclass
class PeersConfig:
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Partial rollout (scheduler.name=partial_rollout): over-provisioning and the staleness bound."""
    one_step_off: OneStepOffConfig = field(default_factory=OneStepOffConfig)
    """Asynchronous rollout (scheduler.name=one_step_off): how many steps it runs ahead of training."""


register_section("peers", PeersConfig, "The peers tail batching is measured against (scheduler.name=partial_rollout "
                                       "or one_step_off).")

"""The arms RollPacker is measured against, written as plug-ins through the loop's seam.

What users of the field's systems turn on when the long tail hurts, instead of tail batching:

* ``partial_rollout`` (slime's APRIL, arXiv 2509.18521): over-provision, stop at P0 complete
  groups, keep the unfinished responses and continue them next step under newer weights
  (:mod:`rollpacker.peers.partial_rollout`);
* ``one_step_off`` (veRL's one-step-off-policy async): step t+1's rollout runs while step t
  trains, so every batch after the first is one policy version old; ``peers.one_step_off.max_staleness``
  = k runs it k steps ahead (:mod:`rollpacker.peers.one_step_off`).

Both buy speed with off-policy tokens: each declares its staleness bound
(``RolloutScheduler.max_staleness``) and the loop trains the older tokens with truncated
importance weights (``megatron_rl.loop.off_policy``). They import only the loop's public seam
(``megatron_rl.loop.hooks``, the shared rollout mechanics of ``megatron_rl.loop.requests``, the baseline
scheduler), nothing of tail batching; ``rollpacker-benchmark --compare peers`` runs them beside
it (docs/peers.md).

Importing this package (the ``rollpacker_peers`` entry point of the ``megatron_rl.plugins``
group, loaded before a config is parsed) registers the two scheduler names and the ``peers``
config section (``peers.partial.*``, ``peers.one_step_off.*``).
"""
from __future__ import annotations

from megatron_rl.config.plugins import register_scheduler
from megatron_rl.config.validation import register_validator
from rollpacker.peers.config import PeersConfig  # noqa: F401  (importing it registers the section)
from rollpacker.peers.one_step_off import validate_one_step_off
from rollpacker.peers.partial_rollout import validate_partial

register_validator(validate_partial)
register_validator(validate_one_step_off)
register_scheduler("partial_rollout", "rollpacker.peers.partial_rollout:PartialRolloutScheduler")
register_scheduler("one_step_off", "rollpacker.peers.one_step_off:OneStepOffScheduler")

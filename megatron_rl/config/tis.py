"""Truncated importance sampling switched on by default where the run trains tokens the engine sampled
from another distribution (a quantized engine, an off-policy scheduler): one ``algorithm.tis_cap`` serves both."""
from __future__ import annotations

from megatron_rl.config.schema import RunConfig


def resolve_quantization_tis(cfg: RunConfig) -> str:
    """Quantized rollout turns truncated importance sampling on by default: with
    rollout.quantization on and algorithm.tis_cap 0, set tis_cap to rollout.quantization_tis_cap.
    Returns the start-up message saying what was decided (empty without quantization)."""
    r, a = cfg.rollout, cfg.algorithm
    if r.quantization == "none":
        return ""
    if a.tis_cap > 0:
        return (f"rollout.quantization={r.quantization}: truncated importance sampling on with the given "
                f"algorithm.tis_cap={a.tis_cap:g}")
    if r.quantization_tis_cap > 0:
        a.tis_cap = r.quantization_tis_cap
        return (f"rollout.quantization={r.quantization}: truncated importance sampling on by default "
                f"(algorithm.tis_cap={a.tis_cap:g}, from rollout.quantization_tis_cap) to correct the quantized "
                "engine's logprob gap; rollout.quantization_tis_cap=0 turns it off")
    return (f"rollout.quantization={r.quantization}: truncated importance sampling OFF "
            "(rollout.quantization_tis_cap=0): the engine/trainer logprob gap goes uncorrected")


def resolve_off_policy_tis(cfg: RunConfig, max_staleness: int) -> str:
    """A scheduler that trains off-policy tokens (staleness bound ``max_staleness`` > 0) turns
    truncated importance sampling on by default: with algorithm.tis_cap 0, set it to
    algorithm.off_policy_tis_cap. Returns the start-up message (empty for an on-policy scheduler).
    Runs after :func:`resolve_quantization_tis`: one cap serves both corrections."""
    a = cfg.algorithm
    if max_staleness <= 0:
        return ""
    what = f"scheduler.name={cfg.scheduler.name} trains tokens up to {max_staleness} policy version(s) old"
    if a.tis_cap > 0:
        return f"{what}: truncated importance sampling on with algorithm.tis_cap={a.tis_cap:g}"
    if a.off_policy_tis_cap > 0:
        a.tis_cap = a.off_policy_tis_cap
        return (f"{what}: truncated importance sampling on by default (algorithm.tis_cap={a.tis_cap:g}, from "
                "algorithm.off_policy_tis_cap); algorithm.off_policy_tis_cap=0 turns it off")
    return f"{what}: truncated importance sampling OFF (algorithm.off_policy_tis_cap=0): they train uncorrected"

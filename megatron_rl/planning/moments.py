"""Every memory moment of a colocated step, in the order the loop makes them, per GPU.

``memory.estimate_memory`` sizes the pieces (trainer weights, gradients, optimizer, activations;
the engine's weight shard and KV cache); this module walks the transitions of a step and adds up
what is resident on the most loaded GPU at each one, so a moment that only exists between two
phases (the weight push, an elastic-TP rebuild, the stream trainer's handoff) is checked too:

1. rollout: engines awake (weights + KV cache), the trainer offloaded or resident;
2. to training: engines asleep (``rollout.sleep_during_train``), the trainer reloaded;
3. train: plus activations and logits of one microbatch per pipeline stage in flight;
4. push, in the order ``Colocation`` / ``WeightSync.push`` makes it: only the engine weights
   woken (vLLM ``wake_up(tags=["weights"])``, vllm/v1/worker/gpu_worker.py), the push staging
   of both sides, the trainer resident for a tensor push (its weights are the source; with
   ``trainer.offload_during_rollout`` its grad buffers are freed first) or already offloaded for a
   file push; then the trainer offloaded and only then the KV cache woken;
5. back to rollout (the first moment again);
6. elastic TP switch (``planner.enabled``): the old engines shut down, the new ones start with
   their whole pool while the trainer is resident to push into them (``WeightSync.load_new_engines``);
7. stream trainer handoff (``stream.enabled``): the trainer resident and training on every GPU
   while the engines not released still generate on theirs.

Moments 6 and 7 are checked only when the recipe turns the feature on; otherwise they are shown
as not used. ``push_order='all_at_once'`` models the earlier order (engines woken with weights
and KV cache while the trainer is still resident, then the push) for comparison and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config import RunConfig
from megatron_rl.planning.architectures import ModelShape
from megatron_rl.planning.memory import GIB, MemoryEstimate

PUSH_ORDERS = ("ordered", "all_at_once")
MIB = 1024 ** 2


@dataclass
class Moment:
    """One instant of a step: what is resident on the most loaded GPU, in GiB."""

    name: str
    parts: dict[str, float]
    checked: bool = True
    """False for a moment of a feature the recipe does not turn on (shown, not enforced)."""
    note: str = ""

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values())


@dataclass
class MomentPlan:
    moments: list[Moment]
    capacity_gib: float
    problems: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Moment:
        return max((m for m in self.moments if m.checked), key=lambda m: m.total_gib)


def push_staging_gib(cfg: RunConfig, shape: ModelShape) -> dict[str, float]:
    """Device memory the weight push adds on each side of one GPU.

    Tensor push (``rollout.weight_sync_format='tensor'``): the trainer rank holds
    ``weight_push_buffers`` buckets of ``weight_push_bucket_mb``; the engine rank receives into
    as many slots and assembles a tensor until all its slices arrived, at most the largest one
    (the embedding / lm_head shard). File formats stage on the host (/dev/shm) and vLLM's loader
    copies tensor by tensor: the largest tensor shard only."""
    r = cfg.rollout
    largest = shape.embedding_params * 2 / r.tensor_parallel_size / GIB  # vocab-parallel embedding shard
    if r.weight_sync_format != "tensor":
        return {"push staging (engine)": largest}
    buckets = r.weight_push_bucket_mb * r.weight_push_buffers * MIB / GIB
    return {"push buffers (trainer)": buckets, "push staging (engine)": buckets + largest}


def _section(cfg: RunConfig, name: str, key: str, default: object) -> object:
    """A plug-in section's field (RollPacker's stream / planner), the default when unregistered."""
    try:
        return getattr(getattr(cfg, name), key)
    except AttributeError:
        return default


def plan_moments(cfg: RunConfig, shape: ModelShape, est: MemoryEstimate,
                 push_order: str = "ordered") -> MomentPlan:
    """Walk a step's transitions; ``problems`` names each checked moment above the GPU's memory."""
    if push_order not in PUSH_ORDERS:
        raise ValueError(f"push_order must be one of {PUSH_ORDERS}, got {push_order!r}")
    t, e = est.trainer, est.engine
    overhead = {"overhead": est.overhead_gib}
    resident = {k: t[k] for k in ("weights", "gradients", "optimizer", "reference weights") if k in t}
    trainer = {f"trainer {k}": v for k, v in resident.items()}
    work = {"trainer activations": t["activations"], "trainer logits": t["logits"]}
    eweights = {"engine weights": e["weights"]}
    kv = {"engine KV cache + reserve": e["kv cache"] + e["activation reserve"]}
    offloaded = bool(est.trainer_offload)
    sleeps = cfg.rollout.sleep_during_train
    asleep = {} if sleeps else {**eweights, **kv}
    staging = push_staging_gib(cfg, shape)
    streams = cfg.rollout.weight_sync_format == "tensor"

    rollout = {**overhead, **({} if offloaded else trainer), **eweights, **kv}
    moments = [
        Moment("rollout", rollout, note="engines awake" + (", trainer offloaded" if offloaded else ", trainer resident")),
        Moment("to training", {**overhead, **asleep, **trainer},
               note=f"engines {'asleep (level %d)' % cfg.rollout.sleep_level if sleeps else 'awake'}, trainer reloaded"),
        Moment("train", {**overhead, **asleep, **trainer, **work}, note="one microbatch per PP stage in flight"),
    ]
    if push_order == "all_at_once":
        moments.append(Moment("push (weights + KV woken, trainer resident)",
                              {**overhead, **trainer, **eweights, **kv, **staging},
                              note="earlier order: every tag woken before the push, trainer offloaded after"))
    else:
        # Colocation.free_trainer_grads: with the offload on, a tensor push frees the grad buffers first.
        push_trainer = ({k: v for k, v in trainer.items() if k != "trainer gradients"} if streams and offloaded
                        else trainer if streams or not offloaded else {})
        moments.append(Moment("push (engine weights woken)", {**overhead, **push_trainer, **eweights, **asleep_kv(kv, sleeps),
                                                              **staging},
                              note=("trainer resident as the push source" + ", grad buffers freed" * offloaded if streams
                                    else "trainer offloaded first" if offloaded else "trainer resident")
                              + ", KV cache still asleep" * sleeps))
    moments.append(Moment("push done, KV cache woken", rollout,
                          note="trainer offloaded before the KV cache is woken" if offloaded else "trainer resident"))
    elastic = bool(_section(cfg, "planner", "enabled", False))
    moments.append(Moment("elastic TP switch (new engines pushed to)", {**overhead, **trainer, **eweights, **kv, **staging},
                          checked=elastic, note="" if elastic else "planner.enabled is false: not used"))
    stream = bool(_section(cfg, "stream", "enabled", False))
    moments.append(Moment("stream handoff (trainer trains, engine generates)", {**overhead, **trainer, **work, **eweights, **kv},
                          checked=stream, note="" if stream else "stream.enabled is false: not used"))
    plan = MomentPlan(moments, est.capacity_gib)
    for m in moments:
        if m.checked and m.total_gib > est.capacity_gib:
            plan.problems.append(f"moment '{m.name}' needs {m.total_gib:.1f} GiB per GPU > {est.capacity_gib:.0f} GiB: "
                                 + ", ".join(f"{k} {v:.1f}" for k, v in m.parts.items()))
    return plan


def asleep_kv(kv: dict[str, float], sleeps: bool) -> dict[str, float]:
    """The KV cache during the push: asleep (not resident) when the engines sleep through training."""
    return {} if sleeps else kv


def format_moments(plan: MomentPlan) -> list[str]:
    """One line per moment: total / capacity, what is resident, and a note."""
    lines = [f"memory moments of a step (GiB per GPU, most loaded GPU, capacity {plan.capacity_gib:.0f}):"]
    for m in plan.moments:
        mark = "" if m.checked else " [not checked]"
        parts = ", ".join(f"{k} {v:.1f}" for k, v in m.parts.items())
        lines.append(f"  {m.name}: {m.total_gib:.1f}{mark} = {parts}" + (f" ({m.note})" if m.note else ""))
    return lines

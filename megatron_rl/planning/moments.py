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
   their whole pool, then sleep and take a push like (4) (``WeightSync.load_new_engines``);
7. stream trainer handoff (``stream.enabled``): the released engines asleep (level 2: weights and KV
   cache freed) and the trainer ranks of the replicas on their GPUs back and training
   (``distributed.replica_release``: the released engines' GPUs are exactly whole DP replicas); on the
   other GPUs an engine generating beside the trainer state as it is during the rollout (offloaded
   with ``trainer.offload_during_rollout``). No GPU holds a generating engine and the training trainer.

Moments 6 and 7 are checked only when the recipe turns the feature on; otherwise they are shown
as not used. ``push_order='all_at_once'`` models the earlier order (engines woken with weights
and KV cache while the trainer is still resident, then the push) for comparison and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.schema import RunConfig
from megatron_rl.planning.architectures import ModelShape
from megatron_rl.planning.memory import GIB, MemoryEstimate

PUSH_ORDERS = ("ordered", "all_at_once")
HANDOFF_TRAIN = "stream handoff, freed GPU (trainer trains)"
HANDOFF_GENERATE = "stream handoff, generating GPU (engine generates)"
HANDOFF_MOMENTS = (HANDOFF_TRAIN, HANDOFF_GENERATE)
"""The stream trainer's two moments: a GPU holds the training trainer or a generating engine, never both."""


def overlap_gib(est: MemoryEstimate) -> float:
    """One GPU holding the training trainer and a generating engine at once (weights, gradients,
    optimizer, activations and logits beside the engine's weights and KV cache): what a colocated
    schedule that trains while it generates would need (one-step-off on the same GPUs), GiB."""
    t, e = est.trainer, est.engine
    trainer = sum(t[k] for k in ("weights", "gradients", "optimizer", "reference weights", "activations", "logits")
                  if k in t)
    return est.overhead_gib + trainer + e["weights"] + e["kv cache"] + e["activation reserve"]


def handoff_gib(plan: "MomentPlan") -> float:
    """The larger of the stream handoff's two moments (GiB per GPU)."""
    return max(m.total_gib for m in plan.moments if m.name in HANDOFF_MOMENTS)
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
        push_trainer = push_trainer_of(trainer, streams, offloaded)
        moments.append(Moment("push (engine weights woken)", {**overhead, **push_trainer, **eweights, **asleep_kv(kv, sleeps),
                                                              **staging},
                              note=("trainer resident as the push source" + ", grad buffers freed" * offloaded if streams
                                    else "trainer offloaded first" if offloaded else "trainer resident")
                              + ", KV cache still asleep" * sleeps))
    moments.append(Moment("push done, KV cache woken", rollout,
                          note="trainer offloaded before the KV cache is woken" if offloaded else "trainer resident"))
    moments += _elastic_moments(cfg, shape, est, overhead, trainer, push_trainer_of(trainer, streams, offloaded), staging)
    stream = bool(_section(cfg, "stream", "enabled", False))
    off = "" if stream else "stream.enabled is false: not used"
    moments.append(Moment(HANDOFF_TRAIN, {**overhead, **trainer, **work}, checked=stream,
                          note=off or "a released engine's GPU: the engine asleep (level 2), its replica's rank trains"))
    moments.append(Moment(HANDOFF_GENERATE, rollout, checked=stream,
                          note=off or "an engine that stays generates; its GPU's rank as during the rollout"
                          + (" (offloaded)" if offloaded else " (resident: trainer.offload_during_rollout is false)")))
    plan = MomentPlan(moments, est.capacity_gib)
    for m in moments:
        if m.checked and m.total_gib > est.capacity_gib:
            plan.problems.append(f"moment '{m.name}' needs {m.total_gib:.1f} GiB per GPU > {est.capacity_gib:.0f} GiB: "
                                 + ", ".join(f"{k} {v:.1f}" for k, v in m.parts.items()))
    plan.problems += staging_outside_budget(cfg, staging, kv)
    return plan


def staging_outside_budget(cfg: RunConfig, staging: dict[str, float], kv: dict[str, float]) -> list[str]:
    """The engine's push staging must live inside the engine's own memory budget
    (``rollout.gpu_memory_utilization``): the receiver allocates it only for the push and returns it
    to the driver before the KV cache is woken (``rollout.worker.push_receiver``), so it borrows the KV cache's
    share of the pool, which is asleep during the push when the engines sleep through training.
    Awake engines (or staging larger than that share) would put it outside vLLM's budget."""
    need = staging.get("push staging (engine)", 0.0)
    room = sum(kv.values())
    if not cfg.rollout.sleep_during_train:
        return [f"push staging ({need:.1f} GiB per engine GPU) would sit outside vLLM's budget: the KV cache is "
                "awake during the push; set rollout.sleep_during_train: true"]
    if need > room:
        return [f"push staging ({need:.1f} GiB per engine GPU) exceeds the KV cache share of the engine's pool it "
                f"borrows during the push ({room:.1f} GiB): lower rollout.weight_push_bucket_mb / weight_push_buffers"]
    return []


def push_trainer_of(trainer: dict[str, float], streams: bool, offloaded: bool) -> dict[str, float]:
    """The trainer state resident during a push: a tensor push reads the weights, and with the offload
    on the grad buffers are freed first (``Colocation.free_trainer_grads``); a file push runs after
    the offload."""
    if streams and offloaded:
        return {k: v for k, v in trainer.items() if k != "trainer gradients"}
    return trainer if streams or not offloaded else {}


def _elastic_moments(cfg: RunConfig, shape: ModelShape, est: MemoryEstimate, overhead: dict[str, float],
                     trainer: dict[str, float], push_trainer: dict[str, float],
                     staging: dict[str, float]) -> list[Moment]:
    """An elastic-TP switch (``rollpacker/elastic_tp.py``): the old engines shut down, the new ones
    start with their whole pool, then take the weights (``WeightSync.load_new_engines``). Their
    weight shard is sized at the smallest TP the planner may pick (``planner.min_tp``, else
    ``rollout.tensor_parallel_size``), where it is largest; the pool is the same fraction of the GPU."""
    on = bool(_section(cfg, "planner", "enabled", False))
    note = "" if on else "planner.enabled is false: not used"
    tp = int(_section(cfg, "planner", "min_tp", 0)) or cfg.rollout.tensor_parallel_size
    weights = {"engine weights": shape.total_params * 2 / tp / GIB}
    kv = {"engine KV cache + reserve": est.engine["pool"] - weights["engine weights"]}
    resident = {} if est.trainer_offload else trainer
    out = [Moment("elastic TP switch: new engines start", {**overhead, **resident, **weights, **kv}, on, note)]
    if cfg.rollout.weight_sync_format != "tensor":  # rank files written with the old engines already gone
        out.append(Moment("elastic TP switch: rank files written", {**overhead, **trainer}, on, note))
    elif cfg.rollout.sleep_during_train:  # new engines asleep, only their weights woken for the push
        out.append(Moment("elastic TP switch: push into new engines", {**overhead, **push_trainer, **weights, **staging},
                          on, note))
    else:
        out.append(Moment("elastic TP switch: push into new engines", {**overhead, **trainer, **weights, **kv,
                                                                         **staging}, on, note))
    return out


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

"""RollPacker's config sections (``tail_batching``, ``stream``, ``planner``) and the checks of
its settings.

The sections are registered with the core config (``megatron_rl.config.register_section``) and
the checks with its validation (``megatron_rl.config.validation.register_validator``) when this module is
imported, so recipes set ``tail_batching.*`` / ``stream.*`` / ``planner.*`` like any core key, the
config reference lists them, and a bad value is refused before any process starts. The core's
``scheduler.name`` picks the scheduler (``tail_batching`` is RollPacker's); the settings of tail
batching live in its own section, read only by ``rollpacker.tail_batching``. Code reads a section
typed as its dataclass (``cfg.section(TailBatchingConfig)``, ``megatron_rl.config.RunConfig.section``);
``cfg.tail_batching`` reaches the same object, untyped.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import RunConfig, register_section
from megatron_rl.config.validation import register_validator
from megatron_rl.config.values import ConfigError, comma_list

ROUND_TYPES = ("long", "short", "baseline")
"""Round types a scheduler reports: tail batching's short and long rounds, the baseline's."""


@dataclass
class TailBatchingConfig:
    eta_prompts: float = 1.25
    """eta_P: a short round launches ceil(eta_P x P0) prompts; the first P0 that complete form the
    batch. 1.0 disables prompt over-provisioning."""
    eta_responses: float = 1.25
    """eta_R: each short-round prompt gets ceil(eta_R x R0) responses; the first R0 that finish are
    kept. 1.0 disables response over-provisioning (no length bias)."""
    max_refills: int = 4
    """DAPO mode (algorithm.filter_zero_variance): most extra launches per step to replace filtered
    groups before the step fails with a clear error."""
    history_routing: bool = False
    """A prompt whose short round in an earlier epoch did not complete (it went to the long-prompt
    queue) goes straight to the queue when drawn again, instead of being launched, aborted and
    queued once more. Off: the prediction is still made and scored (rollout/history/* precision
    and recall) but not acted on."""
    history_responses: int = 4
    """Rollout history: most recent responses kept per prompt, newest first; they are the 'suffix'
    drafter's references for the prompt's next rollouts. 0 keeps outcomes only."""
    history_response_tokens: int = 2048
    """Rollout history: most tokens kept of each stored response (its start)."""
    history_prompts: int = 100000
    """Rollout history: most prompts remembered (least recently seen dropped first); with the two
    keys above this bounds the history's memory and checkpoint size."""


@dataclass
class StreamConfig:
    enabled: bool = False
    """Stream trainer (RollPacker): in the rounds named by ``rounds``, compute gradients on
    completed groups while the rest still generate, and take the single optimizer step after the
    last group. The update equals the ordinary one. Needs algorithm.ppo_mini_batches = 1."""
    rounds: str = "long"
    """Comma-separated round types that stream: 'long' (tail batching's long rounds), 'short',
    'baseline' (every baseline step), or any mix."""
    start_fraction_min: float = 0.2
    """Earliest start: the fraction of the round's prompts complete at the first check."""
    start_fraction_max: float = 0.5
    """Latest start: streaming starts at this completed fraction whatever the engine load."""
    check_interval: float = 0.05
    """Start checks happen each time another this-much of the prompts has completed (5 % steps)."""
    min_new_groups: int = 2
    """After the start, a chunk goes to the trainer only once this many more groups completed
    (small chunks cost a pipeline fill and a Ray round trip each)."""
    release_engines: int = 0
    """Engines to release when streaming starts: their running requests migrate (recompute:
    prompt + generated tokens, budget reduced) to the other engines and they sleep until the
    round ends. Streaming starts early only once the running requests fit on the engines left.
    0 keeps every engine generating. Needs rollout.num_engines > release_engines."""
    train_threads: int = 0
    """CPU only: torch threads per trainer rank while engines are released (the freed cores go to
    training); 0 leaves the thread count alone."""


@dataclass
class PlannerConfig:
    enabled: bool = False
    """Elastic rollout parallelism (RollPacker): each round type runs at its own rollout TP and the
    engines are rebuilt between rounds when it changes, on the same devices
    (rollout.tensor_parallel_size x rollout.num_engines of them)."""
    initial_tp: str = ""
    """Starting TP per round type, e.g. 'short:1,long:2'; wins over ``profile``. Round types
    named in neither start at rollout.tensor_parallel_size."""
    profile: str = ""
    """JSON file of measured rollout seconds per round type and TP (rollpacker-rollout-profile
    builds it from earlier runs); each round type starts at its fastest legal profiled TP."""
    growth: float = 1.05
    """Online rule: preemptions of a round above this multiple of the previous round's (same type,
    same TP) double that round type's TP."""
    quiet_rounds: int = 4
    """Online rule: this many consecutive rounds of a type without preemption halve its TP."""
    max_tp: int = 0
    """Largest rollout TP to consider; 0 means one node's GPUs (on CPU: the rollout devices)."""
    min_tp: int = 0
    """Smallest rollout TP the online rule may halve to; 0 means the smallest starting TP (of
    rollout.tensor_parallel_size, ``profile`` and ``initial_tp``), which is known to fit in memory."""


register_section("tail_batching", TailBatchingConfig,
                 "Tail batching (scheduler.name=tail_batching): over-provisioned short rounds, the rollout history.")
register_section("stream", StreamConfig, "Stream trainer: gradients on completed groups while a round still generates.")
register_section("planner", PlannerConfig, "Elastic rollout TP per round type, switched between rounds.")


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def parse_initial_tp(spec: str) -> dict[str, int]:
    """``planner.initial_tp`` ('short:1,long:2') -> {'short': 1, 'long': 2}; errors name the key."""
    out: dict[str, int] = {}
    for part in comma_list(spec):
        kind, sep, value = part.partition(":")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"planner.initial_tp: expected 'round:tp' pairs like 'short:1,long:2', got {part!r}")
        out[kind.strip()] = int(value)
    return out


def validate_tail_batching(cfg: RunConfig) -> None:
    """``tail_batching.*``: the over-provisioning factors, the DAPO refill budget, the history's bounds."""
    tb = cfg.section(TailBatchingConfig)
    for key in ("eta_prompts", "eta_responses"):
        if getattr(tb, key) < 1.0:
            raise ConfigError(f"tail_batching.{key}: must be >= 1.0 (over-provisioning factor), got {getattr(tb, key)}")
    _positive(tb.max_refills, "tail_batching.max_refills", allow_zero=True)
    _positive(tb.history_responses, "tail_batching.history_responses", allow_zero=True)
    _positive(tb.history_response_tokens, "tail_batching.history_response_tokens")
    _positive(tb.history_prompts, "tail_batching.history_prompts")


def validate_stream(cfg: RunConfig) -> None:
    """``stream.*``: round types, start fractions, and what streaming needs of the rest."""
    st = cfg.section(StreamConfig)
    rounds = comma_list(st.rounds)
    if not rounds or any(r not in ROUND_TYPES for r in rounds):
        raise ConfigError(f"stream.rounds: expected a comma-separated subset of {ROUND_TYPES}, got {st.rounds!r}")
    if not 0 < st.start_fraction_min <= st.start_fraction_max <= 1:
        raise ConfigError("stream.start_fraction_min and stream.start_fraction_max must satisfy "
                          f"0 < min <= max <= 1, got {st.start_fraction_min} and {st.start_fraction_max}")
    if not 0 < st.check_interval <= 1:
        raise ConfigError(f"stream.check_interval: must be in (0, 1], got {st.check_interval}")
    _positive(st.min_new_groups, "stream.min_new_groups")
    _positive(st.release_engines, "stream.release_engines", allow_zero=True)
    _positive(st.train_threads, "stream.train_threads", allow_zero=True)
    if not st.enabled:
        return
    if cfg.algorithm.ppo_mini_batches != 1:
        raise ConfigError("stream.enabled needs algorithm.ppo_mini_batches = 1: streamed gradients add up to "
                          f"one optimizer step (got {cfg.algorithm.ppo_mini_batches})")
    most = most_engines(cfg)
    if st.release_engines >= most:
        raise ConfigError(f"stream.release_engines={st.release_engines} must leave an engine generating "
                          f"(rollout.num_engines={cfg.rollout.num_engines}; at most {most} engine(s) in any round)")
    _check_release(cfg, st)


def most_engines(cfg: RunConfig) -> int:
    """The most engines a round of the run can have: ``rollout.num_engines``, or with the elastic planner
    the rollout devices split at the smallest TP the planner may run (``planner.min_tp``, else the
    smallest starting TP; with a profile any TP may start). E.g. one TP-2 engine whose long rounds the
    planner runs at TP 1 has two engines there, one of which the stream trainer can take: a round with
    fewer engines than it would release streams without a handoff (``rollpacker.stream_trainer``)."""
    pl = cfg.section(PlannerConfig)
    if not pl.enabled:
        return cfg.rollout.num_engines
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    starting = [cfg.rollout.tensor_parallel_size, *parse_initial_tp(pl.initial_tp).values()]
    smallest = pl.min_tp or (1 if pl.profile else min(starting))
    return max(cfg.rollout.num_engines, devices // max(1, smallest))


def _check_release(cfg: RunConfig, st: StreamConfig) -> None:
    """On GPUs the released engines must free whole data-parallel replicas of the trainer at the rollout TP
    each streamed round type starts with (``megatron_rl.distributed.replica_release``), and the trainer must
    have somewhere to train during the round. On CPU the trainer may share the cores: a count that frees no
    whole replica releases the least loaded engines and every replica streams (``rollpacker.stream_trainer``)."""
    from megatron_rl.distributed.gpu_layout import LayoutError, run_layout
    from megatron_rl.distributed.replica_release import choose_release, release_units, replica_ranks

    p = cfg.parallel
    replicas = replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size, p.data_parallel_size,
                             p.pipeline_model_parallel_size)
    split = cfg.cluster.placement == "split"
    if split and st.release_engines:
        raise ConfigError(f"stream.release_engines={st.release_engines}: with cluster.placement=split the trainer "
                          "ranks have GPUs of their own and stream on them while every engine generates; set "
                          "stream.release_engines=0")
    from megatron_rl.config.validation import resolve_device

    if resolve_device(cfg) != "cuda":
        return
    if not st.release_engines:
        if not split:
            raise ConfigError("stream.release_engines=0 with colocated GPUs: the trainer would come back beside "
                              "engines that keep generating on the same GPUs; release engines whose GPUs are whole "
                              "data-parallel replicas (the dry run lists the counts that work)")
        return
    planner = cfg.section(PlannerConfig)
    starts = parse_initial_tp(planner.initial_tp) if planner.enabled else {}
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    for kind in comma_list(st.rounds):
        tp = starts.get(kind, cfg.rollout.tensor_parallel_size)
        try:
            layout = run_layout(cfg, rollout_tp=tp, num_engines=devices // tp)
        except LayoutError:
            return  # the layout's own check names the key (megatron_rl.planning.placement)
        where = f" (the {kind} rounds' rollout TP {tp}, planner.initial_tp)" if tp != cfg.rollout.tensor_parallel_size \
            else ""
        try:
            choose_release(release_units(layout, replicas), st.release_engines, len(layout.engine_gpus))
        except ConfigError as exc:
            raise ConfigError(f"{exc}{where}") from None


def validate_planner(cfg: RunConfig) -> None:
    """``planner.*``: the online rule's settings, the profile file, the initial TPs."""
    pl = cfg.section(PlannerConfig)
    if pl.growth < 1.0:
        raise ConfigError(f"planner.growth: must be >= 1.0, got {pl.growth}")
    _positive(pl.quiet_rounds, "planner.quiet_rounds")
    _positive(pl.max_tp, "planner.max_tp", allow_zero=True)
    _positive(pl.min_tp, "planner.min_tp", allow_zero=True)
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    if pl.profile:
        from rollpacker.tp_profile import ProfileError, load_profile

        try:
            unknown = sorted(set(load_profile(pl.profile)) - set(ROUND_TYPES))
        except ProfileError as exc:
            raise ConfigError(f"planner.profile: {exc}") from None
        if unknown:
            raise ConfigError(f"planner.profile: {pl.profile}: unknown round types {unknown} (one of {ROUND_TYPES})")
    for kind, value in parse_initial_tp(pl.initial_tp).items():
        if kind not in ROUND_TYPES:
            raise ConfigError(f"planner.initial_tp: unknown round type {kind!r} (one of {ROUND_TYPES})")
        if devices % value:
            raise ConfigError(f"planner.initial_tp: TP {value} does not divide the {devices} rollout devices "
                              "(rollout.tensor_parallel_size x rollout.num_engines)")


register_validator(validate_tail_batching)
register_validator(validate_stream)
register_validator(validate_planner)

"""Elastic rollout parallelism: the vLLM tensor-parallel size of each round.

Short and long rounds want different engine TP sizes: a larger TP gives each engine more KV
cache per sequence (fewer preemptions when many long responses decode at once) but fewer
engines and more communication per token. RollPacker picks TP per round type:

* initially from a profile: the measured rollout time of each candidate TP, the fastest wins
  (``rollpacker.tp_profile``); without one, the configured TP;
* then online, after each round of that type (paper, section "Elastic parallelism"):
  preemptions up more than ``growth`` (1.05x) over the previous round at the same TP -> double
  TP; ``quiet_rounds`` (4) consecutive rounds without preemption -> halve TP.

Legal sizes: powers of two that vLLM accepts for the model (divide the attention heads; KV
heads and TP divide one another; divide the padded vocabulary), at most one node's GPUs (a TP
group never crosses a node) and dividing the rollout GPU count (every GPU serves an engine).

The planner is pure logic; ``rollpacker.elastic_tp`` carries out its decisions (engines rebuilt
at the new TP from shards the resharder moves, ``megatron_rl.resharding.rollout_shards``).
:func:`planner_for_run` builds the planner of a run's ``planner`` config; the RL loop
(``elastic_tp.build_elastic_tp``) and the what-if simulator (``rollpacker.simulator``) both use
it, so the simulator's TP decisions are the loop's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.schema import RunConfig
from megatron_rl.model.qwen2 import Qwen2Arch
from megatron_rl.resharding.layouts import VLLMLayout
from rollpacker.config import PlannerConfig, parse_initial_tp
from rollpacker.tp_profile import fastest_tp, load_profile


def legal_tp_sizes(arch: Qwen2Arch, gpus_per_node: int, num_gpus: int, max_tp: int = 0) -> list[int]:
    """Powers of two usable as rollout TP for ``arch`` on ``num_gpus`` GPUs of ``gpus_per_node``."""
    if num_gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"elastic TP: need >= 1 GPU (num_gpus={num_gpus}, gpus_per_node={gpus_per_node})")
    cap = min(gpus_per_node, num_gpus, max_tp or gpus_per_node)
    sizes, tp = [], 1
    while tp <= cap:
        try:
            VLLMLayout(arch, tp)
            if num_gpus % tp == 0:
                sizes.append(tp)
        except ValueError:
            pass
        tp *= 2
    if not sizes:
        raise ValueError(f"elastic TP: no legal tensor-parallel size for {num_gpus} GPUs ({gpus_per_node}/node)")
    return sizes


@dataclass
class TPDecision:
    """The outcome of one observed round."""

    round_type: str
    old_tp: int
    new_tp: int
    reason: str
    """'grow' (preemptions rose), 'shrink' (quiet rounds), or 'keep'."""

    @property
    def changed(self) -> bool:
        return self.new_tp != self.old_tp


@dataclass
class _RoundState:
    tp: int
    last_preemptions: int | None = None  # previous round's count at the current TP
    quiet: int = 0  # consecutive rounds without preemption


@dataclass
class ElasticTPPlanner:
    """Per-round-type rollout TP with the paper's online rule.

    Args:
        sizes: legal TP sizes, ascending (see :func:`legal_tp_sizes`).
        initial: round type -> starting TP (types not listed start at ``sizes[0]``).
        growth: preemption ratio above which TP doubles (1.05 in the paper).
        quiet_rounds: rounds without preemption after which TP halves (4 in the paper).
    """

    sizes: list[int]
    initial: dict[str, int] = field(default_factory=dict)
    growth: float = 1.05
    quiet_rounds: int = 4
    _state: dict[str, _RoundState] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sizes or sorted(self.sizes) != list(self.sizes):
            raise ValueError(f"elastic TP: sizes must be a non-empty ascending list, got {self.sizes}")
        for kind, tp in self.initial.items():
            if tp not in self.sizes:
                raise ValueError(f"elastic TP: initial TP {tp} for {kind!r} rounds is not one of {self.sizes}")
        if self.growth < 1.0 or self.quiet_rounds < 1:
            raise ValueError(f"elastic TP: growth must be >= 1 and quiet_rounds >= 1 "
                             f"(got {self.growth}, {self.quiet_rounds})")

    def _round(self, round_type: str) -> _RoundState:
        if round_type not in self._state:
            self._state[round_type] = _RoundState(self.initial.get(round_type, self.sizes[0]))
        return self._state[round_type]

    def tp_for(self, round_type: str) -> int:
        """The TP the next round of this type should run with."""
        return self._round(round_type).tp

    def observe(self, round_type: str, preemptions: int) -> TPDecision:
        """Record one finished round's preemption count; returns the TP for the next such round."""
        if preemptions < 0:
            raise ValueError(f"elastic TP: preemptions must be >= 0, got {preemptions}")
        st = self._round(round_type)
        old = st.tp
        previous, st.last_preemptions = st.last_preemptions, preemptions
        st.quiet = st.quiet + 1 if preemptions == 0 else 0
        index = self.sizes.index(old)
        rose = previous is not None and preemptions > 0 and preemptions > self.growth * previous
        if rose and index + 1 < len(self.sizes):
            return self._switch(round_type, st, old, self.sizes[index + 1], "grow")
        if st.quiet >= self.quiet_rounds and index > 0:
            return self._switch(round_type, st, old, self.sizes[index - 1], "shrink")
        return TPDecision(round_type, old, old, "keep")

    def _switch(self, round_type: str, st: _RoundState, old: int, new: int, reason: str) -> TPDecision:
        # Preemption counts at different TPs are not comparable: the next round sets a new baseline.
        st.tp, st.last_preemptions, st.quiet = new, None, 0
        return TPDecision(round_type, old, new, reason)

    def state_dict(self) -> dict:
        """Per-round-type state, for the trainer checkpoint."""
        return {k: {"tp": s.tp, "last_preemptions": s.last_preemptions, "quiet": s.quiet}
                for k, s in self._state.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; TPs no longer legal (fewer GPUs) fall back to the largest legal one."""
        self._state = {}
        for kind, s in state.items():
            fitting = [t for t in self.sizes if t <= s["tp"]]
            tp = fitting[-1] if fitting else self.sizes[0]
            self._state[kind] = _RoundState(tp, s["last_preemptions"] if tp == s["tp"] else None, s["quiet"])


def planner_for_run(cfg: RunConfig, sizes: list[int]) -> ElasticTPPlanner:
    """The planner a run of ``cfg`` uses over the legal TP ``sizes`` (see :func:`legal_tp_sizes`).

    A round type starts at its ``planner.initial_tp`` entry, else at its fastest legal TP in
    ``planner.profile``, else at ``rollout.tensor_parallel_size``; growth and quiet rounds come
    from ``planner.growth`` / ``planner.quiet_rounds``. The online rule never goes below
    ``planner.min_tp``, by default the smallest starting TP: the planner knows nothing of memory,
    and a TP smaller than any configured or measured one may not hold the weights plus one
    sequence (its engines would not start). Raises ValueError naming the options when a starting
    TP is not among ``sizes`` or below the floor.
    """
    pl = cfg.section(PlannerConfig)
    initial = {kind: cfg.rollout.tensor_parallel_size for kind in ("short", "long", "baseline")}
    if pl.profile:
        initial.update(fastest_tp(load_profile(pl.profile), sizes))
    initial.update(parse_initial_tp(pl.initial_tp))
    devices = cfg.rollout.tensor_parallel_size * cfg.rollout.num_engines
    illegal = {kind: tp for kind, tp in initial.items() if tp not in sizes}
    if illegal:
        raise ValueError(f"planner.initial_tp / rollout.tensor_parallel_size: {illegal} not among the legal rollout "
                         f"TP sizes {sizes} for this model on {devices} devices")
    floor = pl.min_tp or min(initial.values())
    below = {kind: tp for kind, tp in initial.items() if tp < floor}
    if below:
        raise ValueError(f"planner.min_tp={floor}: starting TPs {below} are below it")
    sizes = [tp for tp in sizes if tp >= floor]
    return ElasticTPPlanner(sizes=sizes, initial=initial, growth=pl.growth,
                            quiet_rounds=pl.quiet_rounds)

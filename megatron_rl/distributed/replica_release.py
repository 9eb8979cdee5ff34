"""Which rollout engines to release so that their GPUs are whole data-parallel replicas of the trainer.

RollPacker's stream trainer computes gradients during a round on GPUs the rollout frees: part of the
engines stop (their requests migrate to the others), and the trainer ranks on those GPUs, and only those,
come back into device memory and train on completed groups. A GPU then holds the trainer or a generating
engine, never both, so the moment fits wherever the recipe's rollout and training fit.

Trainer ranks compute in data-parallel replicas: the TP x CP x PP ranks of one DP index run one model copy
and talk only among themselves until the step's gradient reduce (Megatron's rank order tp-cp-dp-pp, the
rule ``megatron_rl.planning.placement.trainer_coords`` and ``megatron.core.parallel_state`` follow). A
replica can train alone only when every one of its GPUs is freed. The engines and replicas of a colocated
layout (``gpu_layout``) fall into *release units*: the smallest sets of engines whose GPUs are exactly the
GPUs of a set of whole replicas (an engine of a larger rollout TP may cover more than one replica; a replica
spread over several nodes needs each engine on its GPUs). Releasing whole units frees whole replicas;
``stream.release_engines`` must be a sum of unit sizes. Pure: no Ray, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_rl.config.values import ConfigError
from megatron_rl.distributed.gpu_layout import GpuLayout


class ReleaseError(ConfigError):
    """No set of engines of the asked size frees whole replicas (the message names the key)."""


@dataclass(frozen=True)
class ReleaseUnit:
    """Engines whose GPUs are exactly the GPUs of whole DP replicas."""

    engines: tuple[int, ...]
    """Engine indices of the layout (its TP), ascending."""
    replicas: tuple[int, ...]
    """DP indices of the replicas they free, ascending."""
    gpus: tuple[int, ...]
    """The GPUs freed (layout numbering), ascending."""


def replica_ranks(tp: int, cp: int, dp: int, pp: int) -> list[tuple[int, ...]]:
    """Global trainer ranks of each DP replica, in Megatron's rank order tp-cp-dp-pp (TP fastest)."""
    inner = tp * cp
    return [tuple(pp_index * inner * dp + replica * inner + i for pp_index in range(pp) for i in range(inner))
            for replica in range(dp)]


def release_units(layout: GpuLayout, replicas: Sequence[Sequence[int]]) -> list[ReleaseUnit]:
    """The layout's release units (see the module docstring), ordered by their first engine. Empty for a
    split layout (no engine shares a GPU with a trainer rank: the trainer never needs an engine's GPUs)."""
    gpu_of_rank = layout.trainer_gpus
    replica_gpus = [frozenset(gpu_of_rank[r] for r in ranks) for ranks in replicas]
    engine_gpus = [frozenset(gpus) for gpus in layout.engine_gpus]
    # Connected components of "shares a GPU" between engines and replicas (union-find over both).
    parent = list(range(len(engine_gpus) + len(replica_gpus)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for e, egpus in enumerate(engine_gpus):
        for r, rgpus in enumerate(replica_gpus):
            if egpus & rgpus:
                parent[find(e)] = find(len(engine_gpus) + r)
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for e in range(len(engine_gpus)):
        groups.setdefault(find(e), ([], []))[0].append(e)
    for r in range(len(replica_gpus)):
        groups.setdefault(find(len(engine_gpus) + r), ([], []))[1].append(r)
    units = []
    for engines, reps in groups.values():
        if not engines or not reps:
            continue
        freed = frozenset().union(*(engine_gpus[e] for e in engines))
        needed = frozenset().union(*(replica_gpus[r] for r in reps))
        if freed == needed:  # an engine GPU without a trainer rank (or the reverse) frees no whole replica
            units.append(ReleaseUnit(tuple(engines), tuple(reps), tuple(sorted(freed))))
    return sorted(units, key=lambda u: u.engines[0])


def releasable_counts(units: Sequence[ReleaseUnit], total_engines: int) -> list[int]:
    """Engine counts that whole units add up to, leaving at least one engine generating, ascending."""
    reachable = {0}
    for unit in units:
        reachable |= {n + len(unit.engines) for n in reachable}
    return sorted(n for n in reachable if 0 < n < total_engines)


def choose_release(units: Sequence[ReleaseUnit], count: int, total_engines: int,
                   load: Sequence[float] | None = None, key: str = "stream.release_engines") -> list[ReleaseUnit]:
    """Units of ``count`` engines in all; among the ways to make the count, the one whose engines hold the
    least ``load`` (per engine index: requests to migrate), ties to the highest engine indices (replica 0,
    rank 0's, keeps generating). :class:`ReleaseError` naming ``key`` and the counts that work otherwise."""
    counts = releasable_counts(units, total_engines)
    if count not in counts:
        shown = ", ".join(map(str, counts[:8])) + (" ..." if len(counts) > 8 else "")
        why = ("no engine shares its GPUs with whole trainer replicas (data-parallel replicas: every GPU of their "
               "TP x CP x PP ranks)" if not counts else
               f"whole data-parallel replicas are freed by releasing {shown} engine(s); the smallest is {counts[0]}")
        raise ReleaseError(f"{key}={count}: {why} (of {total_engines} engines)")
    weight = [0.0] * total_engines if load is None else list(load)

    def cost(unit: ReleaseUnit) -> tuple[float, int]:
        return sum(weight[e] for e in unit.engines), -unit.engines[0]

    # Subset sum over unit sizes, cheapest first: best[n] = (cost, chosen units) making n engines.
    best: dict[int, tuple[tuple[float, int], list[ReleaseUnit]]] = {0: ((0.0, 0), [])}
    for unit in sorted(units, key=cost):
        for n, (c, chosen) in sorted(best.items(), reverse=True):
            m = n + len(unit.engines)
            if m > count:
                continue
            u_cost = cost(unit)
            candidate = ((c[0] + u_cost[0], c[1] + u_cost[1]), chosen + [unit])
            if m not in best or candidate[0] < best[m][0]:
                best[m] = candidate
    return sorted(best[count][1], key=lambda u: u.engines[0])

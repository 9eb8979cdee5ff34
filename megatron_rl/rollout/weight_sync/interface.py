"""What a weight transport is, and what it needs from the rest of the run: the interfaces of
:mod:`megatron_rl.rollout.weight_sync` (no implementation here but the defaults every transport
shares).

Contract of a :class:`WeightTransport`: :meth:`~WeightTransport.stage` runs on the trainer side
(the trainer resident) and makes the weights of a version ready for engines of a TP;
:meth:`~WeightTransport.load` runs with the engines awake and, once it returns, every completion
the engine produces carries that version. The class attributes tell
:class:`~megatron_rl.rollout.weight_sync.sync.WeightSync` how to order the two around the
device-memory transitions (:class:`SyncColocation`): whether ``load`` reads trainer memory
(``streams_from_trainer``), whether ``stage`` leaves a directory to copy to other nodes
(``writes_directory``), and whether new engines of an elastic switch start without weights
(``starts_engines_empty``). Transports are built by
:func:`~megatron_rl.rollout.weight_sync.factory.make_transport` from ``rollout.weight_sync_format``.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, AsyncContextManager, Awaitable, Callable, Protocol

from megatron_rl.rollout.engine import CapabilityAbsent, RolloutEngine

if TYPE_CHECKING:
    from megatron_rl.config.schema import RunConfig


class WeightWriter(Protocol):
    """The trainer ranks as far as weight export goes (``PolicyGroup`` implements it)."""

    async def write_hf_weights(self, directory: str) -> None: ...
    async def write_rollout_shards(self, rollout_tp: int, directory: str, version: int,
                                   dtype: str) -> dict[str, float]: ...


class SyncColocation(Protocol):
    """The device-memory transitions a sync needs (``training.colocation.Colocation``)."""

    sleep: bool
    """The engines sleep through training (``rollout.sleep_during_train``)."""

    async def to_rollout(self) -> None: ...
    async def offload_trainer(self) -> None: ...
    async def wake_engines(self) -> None: ...
    async def wake_engine_weights(self) -> None: ...
    async def free_trainer_grads(self) -> None: ...
    def trainer_resident(self) -> AsyncContextManager[None]: ...


FanOut = Callable[[str], Awaitable[dict[str, float]]]
"""``fan_out(directory)``: copy a directory rank 0 wrote to every other node; returns
``fanout_mb``, ``fanout_nodes``, ``fanout_s``."""


class WeightTransport(abc.ABC):
    """How weights travel from the trainer ranks into engines of a given TP."""

    name: str = "transport"
    streams_from_trainer: bool = False
    """True when :meth:`load` reads trainer memory (the trainer must stay resident meanwhile)."""
    writes_directory: bool = True
    """True when :meth:`stage` leaves a directory for the engines (fanned out on multi-node runs)."""
    starts_engines_empty: bool = False
    """True when engines of an elastic switch start without weights (:meth:`new_engine_dir`) and
    get :meth:`load` once up; False: they start from rank files."""

    def __init__(self, writer: WeightWriter, directory: str, dtype: str) -> None:
        self.writer = writer
        self.directory = directory
        self.dtype = dtype

    @classmethod
    def for_run(cls, writer: WeightWriter, directory: str, dtype: str, cfg: RunConfig,
                on_gpu: bool) -> WeightTransport:
        """The transport as a run configures it (file transports need nothing more)."""
        return cls(writer, directory, dtype)

    @abc.abstractmethod
    async def stage(self, version: int, tp: int) -> dict[str, float]:
        """Trainer side: make the weights of ``version`` ready for engines of TP ``tp``; returns
        metrics (without the ``weight_sync/`` prefix)."""

    async def load(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        """Engine side: load what :meth:`stage` made ready; completions then carry ``version``.
        Figures: the engine's own (``engine_s``; for rank files also ``engine_read_s``, the file
        into memory, and ``engine_load_s``, vLLM's loaders)."""
        figures = await engine.reload_weights(self.directory, version)
        return dict(figures or {})

    async def new_engine_dir(self, tp: int, version: int) -> str:
        """Elastic switch, when :attr:`starts_engines_empty`: the directory engines of TP ``tp``
        start from *without* weights (they get :meth:`load` right after they are up)."""
        raise CapabilityAbsent(f"{type(self).__name__} starts new engines from rank files")

"""The one owner of weight movement from the trainer ranks into the rollout engines.

:class:`WeightSync` does the whole per-step sync (:meth:`WeightSync.push`) and writes the weights
for engines of a new tensor-parallel size on an elastic switch
(:meth:`WeightSync.write_for_new_engines`, :meth:`WeightSync.load_new_engines`). *How* bytes
travel is a :class:`WeightTransport` (``rollout.weight_sync_format``):

* ``tensor`` (the default, ``tensor_transport.TensorTransport``): every trainer rank sends each
  engine rank exactly its slice, cut from its own Megatron shards, in bounded buckets through
  vLLM's weight-transfer API (shared memory / CUDA IPC on a node, gloo / NCCL across nodes);
  the engines load it in place. No files, no fan-out; new engines of an elastic switch start
  with dummy weights and get a push.
* :class:`HFFiles` (``hf``): rank 0 gathers the HF-named state dict and writes safetensors; every
  engine rank reads the whole model and vLLM's loaders cut their slice.
* :class:`ShardedFiles` (``sharded``): the trainer ranks move their Megatron shards through the
  resharder into one file per engine rank (``megatron_rl.resharding.rollout_shards``); each
  engine rank reloads only its own file in place (``vllm_worker_ext``).

A push is: the transport *stages* the weights (trainer memory -> files), on a multi-node run the
directory is copied to the other nodes (``weight_fanout``), then device memory goes back to the
rollout side (``Colocation.to_rollout``: trainer offloaded, engines woken) and the transport
*loads* them into the engines, which tag later completions with the new version. A transport
that streams straight from trainer memory into awake engines (``streams_from_trainer``) is
loaded between waking the engines and offloading the trainer instead.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, AsyncContextManager, Awaitable, Callable, Protocol

from megatron_rl.rollout.engine import CapabilityAbsent, RolloutEngine

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig


class WeightWriter(Protocol):
    """The trainer ranks as far as weight export goes (``PolicyGroup`` implements it)."""

    async def write_hf_weights(self, directory: str) -> None: ...
    async def write_rollout_shards(self, rollout_tp: int, directory: str, version: int,
                                   dtype: str) -> dict[str, float]: ...


class SyncColocation(Protocol):
    """The device-memory transitions a sync needs (``training.colocation.Colocation``)."""

    async def to_rollout(self) -> None: ...
    async def offload_trainer(self) -> None: ...
    async def wake_engines(self) -> None: ...
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


class HFFiles(WeightTransport):
    """``rollout.weight_sync_format=hf``: HF safetensors of the whole model."""

    name = "hf"

    async def stage(self, version: int, tp: int) -> dict[str, float]:
        await self.writer.write_hf_weights(self.directory)
        return {}


class ShardedFiles(WeightTransport):
    """``rollout.weight_sync_format=sharded``: one resharded file per engine rank."""

    name = "sharded"

    async def stage(self, version: int, tp: int) -> dict[str, float]:
        stats = await self.writer.write_rollout_shards(tp, self.directory, version, self.dtype)
        return {"reshard_mb": (stats["bytes_sent"] + stats["bytes_local"]) / 1e6, "reshard_s": stats["seconds"]}


def _tensor_transport() -> type[WeightTransport]:
    from megatron_rl.rollout.tensor_transport import TensorTransport  # it builds on this module

    return TensorTransport


TRANSPORTS: dict[str, type[WeightTransport] | Callable[[], type[WeightTransport]]] = {
    "hf": HFFiles, "sharded": ShardedFiles, "tensor": _tensor_transport}
"""``rollout.weight_sync_format`` -> transport class (or a function returning it, for one whose
module imports this one): 'tensor' is ``tensor_transport.TensorTransport``."""


def transport_class(fmt: str) -> type[WeightTransport]:
    """The transport class of ``rollout.weight_sync_format`` ``fmt``."""
    try:
        entry = TRANSPORTS[fmt]
    except KeyError:
        raise ValueError(f"rollout.weight_sync_format: {fmt!r} is not one of {sorted(TRANSPORTS)}") from None
    return entry if isinstance(entry, type) else entry()


class WeightSync:
    """Moves the trainer's weights into the engines; the loop and plug-ins call only this.

    Args:
        transport: the per-step transport (see :data:`TRANSPORTS`).
        writer: the trainer ranks (for rank files of new engines on an elastic switch).
        engine: the engines the loop generates with; their ``tensor_parallel_size`` decides the
            layout written.
        colocation: device-memory owner (trainer offload / engine wake order).
        fan_out: multi-node runs: copies a directory to the other nodes; None on one node.
    """

    def __init__(self, transport: WeightTransport, writer: WeightWriter, engine: RolloutEngine,
                 colocation: SyncColocation, fan_out: FanOut | None = None) -> None:
        self.transport = transport
        self.writer = writer
        self.engine = engine
        self.colocation = colocation
        self.fan_out = fan_out

    @property
    def directory(self) -> str:
        """The weight directory engines read (and new engines start from)."""
        return self.transport.directory

    async def push(self, version: int) -> dict[str, float]:
        """Bring the engines to the trainer's weights, tagged ``version``; ends with the memory on
        the rollout side. Returns ``weight_sync/*`` metrics."""
        tp = self.engine.tensor_parallel_size
        figures = dict(await self.transport.stage(version, tp))
        if self.transport.writes_directory:
            figures.update(await self._fan_out())
        if self.transport.streams_from_trainer:
            await self.colocation.wake_engines()
            figures.update(await self.transport.load(self.engine, version))
            await self.colocation.offload_trainer()
        else:
            await self.colocation.to_rollout()
            figures.update(await self.transport.load(self.engine, version))
        return {f"weight_sync/{key}": value for key, value in figures.items()}

    async def write_for_new_engines(self, tp: int, version: int) -> tuple[str, dict[str, float]]:
        """Elastic switch (the old engines are shut down): where engines of TP ``tp`` start from.

        With a transport that streams into engines (the tensor push), a directory of config and
        tokenizer only: the engines load dummy weights and refuse requests until
        :meth:`load_new_engines` pushes the current ones, so no model copy lands on disk. Else the
        current weights as rank files in the weight directory (``/dev/shm`` keeps one model copy:
        the next push rewrites it), with the resharder's figures (``reshard_mb``, ``reshard_s``,
        ``reshard_rounds``; ``fanout_*`` on multi-node runs)."""
        if self.transport.starts_engines_empty:
            return await self.transport.new_engine_dir(tp, version), {}
        async with self.colocation.trainer_resident():
            stats = await self.writer.write_rollout_shards(tp, self.directory, version, self.transport.dtype)
        figures = {"reshard_mb": (stats["bytes_sent"] + stats["bytes_local"]) / 1e6,
                   "reshard_s": stats["seconds"], "reshard_rounds": stats["rounds"]}
        figures.update(await self._fan_out())
        return self.directory, figures

    async def load_new_engines(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        """Elastic switch, after the new engines started from :meth:`write_for_new_engines`: push
        the current weights into them when they started without (the trainer resident for it);
        nothing when they started from rank files. Returns the transport's figures."""
        if not self.transport.starts_engines_empty:
            return {}
        async with self.colocation.trainer_resident():
            return await self.transport.load(engine, version)

    async def _fan_out(self) -> dict[str, float]:
        return await self.fan_out(self.directory) if self.fan_out is not None else {}


def make_transport(fmt: str, writer: WeightWriter, directory: str, dtype: str, cfg: RunConfig | None = None,
                   on_gpu: bool = False) -> WeightTransport:
    """The transport ``rollout.weight_sync_format`` names, set up from the run config when given
    (:meth:`WeightTransport.for_run`; the tensor push needs it)."""
    cls = transport_class(fmt)
    return cls(writer, directory, dtype) if cfg is None else cls.for_run(writer, directory, dtype, cfg, on_gpu)

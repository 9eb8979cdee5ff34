"""The one owner of weight movement from the trainer ranks into the rollout engines.

:class:`WeightSync` does the whole per-step sync (:meth:`WeightSync.push`) and writes the weights
for engines of a new tensor-parallel size on an elastic switch
(:meth:`WeightSync.write_for_new_engines`, :meth:`WeightSync.load_new_engines`). *How* bytes
travel is its :class:`~megatron_rl.rollout.weight_sync.interface.WeightTransport` (the package
docstring lists them).

A push is: the transport *stages* the weights (trainer memory -> files), on a multi-node run the
directory is copied to the other nodes (``fan_out``, :mod:`~megatron_rl.rollout.weight_sync.fanout`),
then the trainer is offloaded, only the engines' weights are woken, the transport *loads* the new
weights into them (the engines tag later completions with the new version) and only then their KV
cache is woken. A transport that streams straight from trainer memory (``streams_from_trainer``)
loads while the trainer is still resident: its grad buffers freed, engine weights woken, load,
trainer offloaded, KV cache woken. The engines' KV cache and the trainer's state are never on the GPU together with the push
(the push moment of ``megatron_rl.planning.moments``).
"""
from __future__ import annotations

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.weight_sync.interface import FanOut, SyncColocation, WeightTransport, WeightWriter


class WeightSync:
    """Moves the trainer's weights into the engines; the loop and plug-ins call only this.

    Args:
        transport: the per-step transport (``factory.make_transport``).
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
            await self.colocation.free_trainer_grads()  # the weights are the source; the gradients are spent
        else:
            await self.colocation.offload_trainer()
        await self.colocation.wake_engine_weights()
        figures.update(await self.transport.load(self.engine, version))
        await self.colocation.offload_trainer()  # no-op when done above
        await self.colocation.wake_engines()
        return {f"weight_sync/{key}": value for key, value in figures.items()}

    async def load_into(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        """Bring a replacement engine (started from the initial weights) to the weights of the
        last :meth:`push`, ``version``: a push from the trainer ranks (the trainer resident for
        it), or a reload of the weight directory that push wrote. Returns ``weight_sync/*``."""
        if self.transport.streams_from_trainer:
            async with self.colocation.trainer_resident():
                figures = await self.transport.load(engine, version)
        else:
            figures = await self.transport.load(engine, version)
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
        nothing when they started from rank files. Returns the transport's figures.

        With ``rollout.sleep_during_train`` the memory moves as in :meth:`push`: the new engines
        (dummy weights, empty KV cache: nothing to keep) sleep at level 2 before the trainer comes
        back, its grad buffers are freed, only their weights wake for the push, and their KV cache
        wakes once the trainer is offloaded again (the elastic moment of ``planning.moments``)."""
        if not self.transport.starts_engines_empty:
            return {}
        ordered = self.colocation.sleep
        if ordered:
            await engine.sleep(2)
        async with self.colocation.trainer_resident():
            await self.colocation.free_trainer_grads()
            if ordered:
                await engine.wake_up(["weights"])
            figures = await self.transport.load(engine, version)
        if ordered:
            await engine.wake_up(["kv_cache"])
        return figures

    async def _fan_out(self) -> dict[str, float]:
        return await self.fan_out(self.directory) if self.fan_out is not None else {}

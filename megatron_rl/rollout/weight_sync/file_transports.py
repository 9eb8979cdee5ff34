"""The file transports: weights go through a directory on the engines' node (``/dev/shm`` by
default, :mod:`~megatron_rl.rollout.weight_sync.sync_dir`), copied to the other nodes on a
multi-node run (:mod:`~megatron_rl.rollout.weight_sync.fanout`), and the engines reload from it.
"""
from __future__ import annotations

from megatron_rl.rollout.weight_sync.interface import WeightTransport


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

"""``rollout.weight_sync_format`` -> the transport that implements it: the one registry of
transport classes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.rollout.weight_sync.file_transports import HFFiles, ShardedFiles
from megatron_rl.rollout.weight_sync.interface import WeightTransport, WeightWriter
from megatron_rl.rollout.weight_sync.push.transport import TensorTransport

if TYPE_CHECKING:
    from megatron_rl.config.schema import RunConfig

TRANSPORTS: dict[str, type[WeightTransport]] = {cls.name: cls for cls in (HFFiles, ShardedFiles, TensorTransport)}
"""``rollout.weight_sync_format`` -> transport class ('hf', 'sharded', 'tensor')."""


def transport_class(fmt: str) -> type[WeightTransport]:
    """The transport class of ``rollout.weight_sync_format`` ``fmt``."""
    try:
        return TRANSPORTS[fmt]
    except KeyError:
        raise ValueError(f"rollout.weight_sync_format: {fmt!r} is not one of {sorted(TRANSPORTS)}") from None


def make_transport(fmt: str, writer: WeightWriter, directory: str, dtype: str, cfg: RunConfig | None = None,
                   on_gpu: bool = False) -> WeightTransport:
    """The transport ``rollout.weight_sync_format`` names, set up from the run config when given
    (:meth:`WeightTransport.for_run`; the tensor push needs it)."""
    cls = transport_class(fmt)
    return cls(writer, directory, dtype) if cfg is None else cls.for_run(writer, directory, dtype, cfg, on_gpu)

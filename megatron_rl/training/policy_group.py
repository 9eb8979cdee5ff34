"""Driver-side handle on the trainer ranks (Megatron workers hosted in Ray actors).

Every call goes to all ranks (SPMD: a collective called on only some ranks of a gloo group hangs)
through one forwarder, :meth:`TrainerRank.call`, which runs the named ``MegatronWorker`` method
inside the CPU device mode where needed. :class:`PolicyGroup` is async only: it awaits the ranks'
ObjectRefs, so the driver's event loop keeps generating and scoring while the trainer works
(RollPacker's stream trainer relies on it), and every call has a timeout, so a dead rank is an
error rather than a silent hang. Set-up code outside a loop uses ``asyncio.run``.

A rank that dies (killed, out of memory, its node lost) or fails leaves the others waiting in a
collective for it: the call then ends :data:`PEER_GRACE_S` after the first failure with a
:class:`TrainerRankError` naming the failed ranks (pid, node) and those still waiting, and the
group counts as broken: :meth:`PolicyGroup.shutdown` kills the actors without asking busy or
dead ranks to tear down (a stopped or blocked rank would never answer).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

import ray

from megatron_rl.config.schema import RunConfig
from megatron_rl.distributed.errors import one_line
from megatron_rl.distributed.replica_release import replica_ranks
from megatron_rl.runtime.aio import wait_for
from megatron_rl.runtime.import_cost import collector_paused, preimport
from megatron_rl.sample import Sample

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = float(os.environ.get("MEGATRON_RL_CALL_TIMEOUT_S", "1800"))
PEER_GRACE_S = 5.0
"""After one rank of a call failed, how long the others get to report their own error (a rank
blocked in a collective with a dead one never answers)."""
SHUTDOWN_TIMEOUT_S = 30.0
"""Longest wait for the ranks' own teardown before their actors are killed anyway."""
RANK_MODULES = ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
                "megatron_rl.training.megatron_worker")
"""The Megatron-Core parts every rank builds (model, optimizer, DDP), then the worker: imported
first thing by :func:`import_rank_modules`."""
_TAKES_LOSS_FN = ("train_step", "accumulate_gradients")
"""Worker methods that get the run's policy loss (built rank-side: it is not picklable cheaply)."""


def import_rank_modules(device: str, pause: bool = True) -> None:
    """A rank's first imports, with the collector paused (``megatron_rl.runtime.import_cost``): torch, on CPU
    the CUDA-to-CPU shim (it imports and patches parts of Megatron-Core, so it comes first), then
    :data:`RANK_MODULES`."""
    with collector_paused(pause):
        preimport("torch", pause=False)  # the block pauses the collector (or, as a baseline, not)
        if device == "cpu":
            from megatron_rl.distributed.cpu_shim import apply_cpu_shim

            apply_cpu_shim()
        preimport(*RANK_MODULES, pause=False)


class TrainerRank:
    """Ray actor body: one Megatron rank. Heavy imports happen here, not on the driver."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int, device: str):
        import_rank_modules(device)
        if device == "cpu":
            import torch

            torch.set_num_threads(1)
        from megatron_rl.training.megatron_worker import MegatronWorker

        self.cfg = cfg
        self.device = device
        self.worker = MegatronWorker(cfg, rank, world_size, master_addr, master_port)

    def call(self, name: str, *args: Any) -> Any:
        """Run ``MegatronWorker.<name>(*args)`` (or one of this class's rank-side helpers) here."""
        helper = _RANK_HELPERS.get(name)
        if helper is not None:
            return helper(self, *args)
        if name in _TAKES_LOSS_FN:  # (samples, loss_fn, *options): the worker's signature
            args = (args[0], self._loss_fn(), *args[1:])
        if self.device == "cpu":
            from megatron_rl.distributed.cpu_shim import cpu_device_mode

            # The device-rewriting mode is thread-local: enter it in the thread running the call.
            with cpu_device_mode():
                return getattr(self.worker, name)(*args)
        return getattr(self.worker, name)(*args)

    def _loss_fn(self):
        from megatron_rl.algorithms.losses import compute_policy_loss

        return functools.partial(compute_policy_loss, cfg=self.cfg.algorithm)

    def set_num_threads(self, n: int) -> None:
        import torch

        # A sync actor runs every call on the same thread, so this reaches the compute thread.
        torch.set_num_threads(n)

    def write_hf_weights(self, directory: str) -> bool:
        """Gather the HF-named weights; rank 0 writes them as safetensors for the engine."""
        state = self.call("export_hf_state_dict")
        if state is None:
            return False
        from megatron_rl.quantization.scheme import quant_spec, quantize_state_dict
        from megatron_rl.rollout.weight_sync.hf_files import engine_dtype, write_hf_weights

        # rollout.quantization: the transport's quantization step, on the HF names it writes.
        spec = quant_spec(self.cfg.rollout.quantization, engine_dtype(self.cfg.model.hf_path, self.device != "cpu"))
        write_hf_weights(quantize_state_dict(state, spec), directory)
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def node_address(self) -> tuple[str, str]:
        """(Ray node id, IP address) of this rank's node."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def gpu_uuid(self) -> str:
        """UUID of this rank's GPU ('' on CPU): the tensor weight push pairs by it
        (``rollout.weight_sync.push.topology``)."""
        from megatron_rl.rollout.weight_sync.push.topology import device_uuid

        if self.device == "cpu":
            return ""
        import torch

        return device_uuid(torch.device("cuda", torch.cuda.current_device()))

    def whereabouts(self) -> dict:
        """This rank's pid, process start time, host name, Ray node id and IP: what an error about
        it names, and how the driver finds its process on the same machine."""
        import socket

        import psutil

        node, ip = self.node_address()
        return {"pid": os.getpid(), "started": psutil.Process().create_time(), "host": socket.gethostname(),
                "node": node, "ip": ip}


_RANK_HELPERS = {"set_num_threads": TrainerRank.set_num_threads, "write_hf_weights": TrainerRank.write_hf_weights,
                 "node_id": TrainerRank.node_id, "node_address": TrainerRank.node_address, "gpu_uuid": TrainerRank.gpu_uuid,
                 "whereabouts": TrainerRank.whereabouts}
"""Calls answered by the rank itself rather than its MegatronWorker."""


class TrainerRankError(RuntimeError):
    """A call on the trainer ranks failed because some rank died or did not answer; the message
    names each such rank (global rank, pid, node) and the call."""


class TrainerRankTimeout(TrainerRankError, TimeoutError):
    """No rank failed, but some did not finish the call within ``CALL_TIMEOUT_S``."""


class PolicyGroup:
    """All trainer ranks of the run. Methods mirror MegatronWorker's and return rank 0's result
    (every rank computes the same for these; see ``training.policy.Policy`` for the contract)."""

    def __init__(self, cfg: RunConfig, device: str, actor_options: dict | list[dict], master_port: int,
                 master_addr: str | None = None):
        """``actor_options``: Ray options for every rank, or one dict per rank (GPU runs place each rank
        in its own bundle: ``cluster.RunPlacement.all_trainer_options``). ``master_addr``: where rank 0
        hosts the rendezvous store (``RunPlacement.master_addr``: rank 0's node); default loopback on
        one node, else the driver's address."""
        p = cfg.parallel
        self.cfg = cfg
        self.world_size = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                           * p.context_parallel_size * p.data_parallel_size)
        self._replicas = replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size, p.data_parallel_size,
                                       p.pipeline_model_parallel_size)
        self._replica_tokens: dict[int, float] = {}
        """Tokens each DP replica trained since the last optimizer step (streamed chunks)."""
        per_rank = actor_options if isinstance(actor_options, list) else [actor_options] * self.world_size
        if len(per_rank) != self.world_size:
            raise ValueError(f"PolicyGroup: {len(per_rank)} actor option sets for {self.world_size} trainer ranks")
        remote_cls = ray.remote(TrainerRank)
        if master_addr is None:
            master_addr = "127.0.0.1" if cfg.cluster.num_nodes == 1 else ray.util.get_node_ip_address()
        self.actors = [
            remote_cls.options(**per_rank[rank], name=None).remote(cfg, rank, self.world_size, master_addr,
                                                                   master_port, device)
            for rank in range(self.world_size)
        ]
        self.where = [f"rank {rank}" for rank in range(self.world_size)]
        """Per rank, where it runs (filled by :meth:`load_hf`), for error messages."""
        self.broken = ""
        """Why the group cannot be used any more (a rank died, failed or hung); '' while healthy."""
        self._in_flight: dict[int, Any] = {}
        """Per rank, the ObjectRef of a call it may still be running (left behind by a failed call)."""
        self._ranks: list[dict] = []
        """Per rank, its ``whereabouts`` (pid, host, node), once :meth:`load_hf` asked."""

    async def _all(self, name: str, *args: Any, ranks: list[int] | None = None,
                   args_of: Any = None) -> list[Any]:
        """``name(*args)`` on every rank at once (``ranks``: on those only; ``args_of(rank)``: each its
        own arguments); each called rank's result, in the order called. Raises
        :class:`TrainerRankError` when a rank fails or dies (see the module docstring)."""
        if self.broken:
            raise TrainerRankError(f"trainer ranks: {name} refused, the group is broken ({self.broken})")
        called = list(range(len(self.actors))) if ranks is None else list(ranks)
        refs = [self.actors[r].call.remote(name, *(args if args_of is None else args_of(r))) for r in called]
        calls = [asyncio.ensure_future(self._await(ref)) for ref in refs]
        waited = CALL_TIMEOUT_S
        try:
            done, pending = await asyncio.wait(calls, timeout=CALL_TIMEOUT_S, return_when=asyncio.FIRST_EXCEPTION)
            if pending and any(c.exception() is not None for c in done):
                _, pending = await asyncio.wait(pending, timeout=PEER_GRACE_S)
                waited = PEER_GRACE_S
        except asyncio.CancelledError:  # the caller gave up (its own timeout): the ranks may still be busy
            self._in_flight.update(zip(called, refs))
            for call in calls:
                call.cancel()
            raise
        errors = [c.exception() for c in calls if c not in pending and c.exception() is not None]
        if not pending and not errors:
            return [c.result() for c in calls]
        if not pending and not any(isinstance(e, ray.exceptions.RayActorError) for e in errors):
            raise errors[0]  # every rank answered (e.g. all refused a bad batch): the group is still whole
        for call in pending:
            call.cancel()
        self._in_flight.update((called[i], refs[i]) for i, c in enumerate(calls) if c in pending)
        problems = []
        for rank, call in zip(called, calls):
            if call in pending:
                what = "after the failure" if waited == PEER_GRACE_S else "in all"
                problems.append(f"rank {rank} ({self.where[rank]}) gave no answer within {waited:g} s {what}")
            elif call.exception() is not None:
                problems.append(f"rank {rank} ({self.where[rank]}) {self._failure(call.exception())}")
        self.broken = f"{name}: " + "; ".join(problems)
        error = TrainerRankError if errors else TrainerRankTimeout
        scope = f"{len(self.actors)} ranks" if ranks is None else f"ranks {called} of {len(self.actors)}"
        raise error(f"trainer ranks failed during {name} ({scope}): " + "; ".join(problems))

    @staticmethod
    async def _await(ref: Any) -> Any:
        return await ref

    @staticmethod
    def _failure(exc: BaseException) -> str:
        if isinstance(exc, ray.exceptions.RayActorError):
            return f"died: {one_line(exc)}"
        return f"failed: {one_line(exc)}"

    async def _first(self, name: str, *args: Any) -> Any:
        return (await self._all(name, *args))[0]

    async def load_hf(self, hf_path: str) -> None:
        """Build the policy (+ optimizer, + reference model) from an HF checkpoint on every rank."""
        self._ranks = await self._all("whereabouts")
        self.where = [f"pid {r['pid']} on node {r['node'][:12]} ({r['ip']})" for r in self._ranks]
        await self._all("load_hf", hf_path)

    # ------------------------------------------------------------------ data-parallel replicas
    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas (model copies) of the trainer."""
        return self.cfg.parallel.data_parallel_size

    def replica_ranks(self, replica: int) -> list[int]:
        """Global ranks of DP replica ``replica`` (its TP x CP x PP ranks, Megatron's rank order)."""
        return list(self._replicas[replica])

    def ranks_of(self, replicas: list[int]) -> list[int]:
        """Global ranks of ``replicas``, ascending."""
        return sorted(r for replica in replicas for r in self._replicas[replica])

    def _split(self, samples: list[Sample], replicas: list[int]) -> dict[int, list[Sample]]:
        """``samples`` split over ``replicas`` (``rank_batches.replica_shares``), evening out the tokens
        each replica trained since the last optimizer step."""
        from megatron_rl.training.rank_batches import replica_shares  # torch: never on the driver's import

        shares = replica_shares([s.num_tokens for s in samples], replicas, self._replica_tokens)
        return {r: [samples[i] for i in idx] for r, idx in shares.items()}

    def _check_replicas(self, replicas: list[int]) -> list[int]:
        bad = [r for r in replicas if not 0 <= r < self.num_replicas]
        if bad or not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas {replicas}: expected distinct DP indices in 0..{self.num_replicas - 1}")
        return sorted(replicas)

    # ------------------------------------------------------------------ compute
    async def compute_logprobs(self, samples: list[Sample], which: str = "policy",
                               replicas: list[int] | None = None) -> list[list[float]]:
        """Per-token logprobs of each sample's response under ``which`` ('policy' / 'reference'):
        on every rank, or (``replicas``) on those DP replicas' ranks only, each scoring its own share
        (``MegatronWorker.compute_logprobs(own=True)``; the other replicas are not called)."""
        if replicas is None:
            return await self._first("compute_logprobs", samples, which)
        shares = self._split(samples, self._check_replicas(replicas))
        replica_of = {r: replica for replica in shares for r in self._replicas[replica]}
        results = await self._all("compute_logprobs", ranks=sorted(replica_of),
                                  args_of=lambda r: (shares[replica_of[r]], which, True))
        by_id: dict[int, list[float]] = {}
        for rank, result in zip(sorted(replica_of), results):
            if result is not None:
                by_id.update((id(s), lp) for s, lp in zip(shares[replica_of[rank]], result))
        return [by_id[id(s)] for s in samples]

    async def train_step(self, samples: list[Sample]) -> dict:
        """One training step (``algorithm.ppo_mini_batches`` optimizer steps) over ``samples``."""
        return await self._first("train_step", samples)

    async def accumulate_gradients(self, samples: list[Sample], replicas: list[int] | None = None) -> dict:
        """Forward+backward of ``samples`` added to the pending step's gradient, no optimizer step;
        returns the chunk's raw metrics over the ranks. ``replicas=None``: every rank is called and
        each DP rank takes its share. Else only those DP replicas' ranks compute, each on its own share
        (split here, evening out the tokens each replica trained since the last optimizer step, so
        replicas that streamed earlier take less afterwards and all finish together); the others are
        not called and may stay out of device memory."""
        from megatron_rl.training.step_metrics import combine

        if replicas is None:
            results = await self._all("accumulate_gradients", samples)
        else:
            shares = self._split(samples, self._check_replicas(replicas))
            replica_of = {r: replica for replica in shares for r in self._replicas[replica]}
            results = await self._all("accumulate_gradients", ranks=sorted(replica_of),
                                      args_of=lambda r: (shares[replica_of[r]], True))
            for replica, share in shares.items():
                self._replica_tokens[replica] = self._replica_tokens.get(replica, 0.0) + sum(s.num_tokens for s in share)
        total: dict[str, float] = {}
        for part in results:
            for key, value in (part or {}).items():
                combine(total, key, value)
        return total

    async def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict:
        """The one optimizer step over everything accumulated, normalised by the full batch's
        response tokens and sequences; metrics as :meth:`train_step` returns them. Every rank."""
        try:
            return await self._first("apply_accumulated_gradients", num_tokens_total, num_seqs_total)
        finally:
            self._replica_tokens = {}

    def replica_tokens(self) -> dict[int, float]:
        """Tokens (prompt + response) each DP replica trained since the last optimizer step."""
        return dict(self._replica_tokens)

    async def free_grad_buffers(self) -> dict:
        """Every rank frees only its grad buffers (the first part of :meth:`offload_for_rollout`,
        before a push that reads the weights); returns rank 0's bytes. Only ``Colocation`` calls this."""
        return await self._first("free_grad_buffers")

    async def offload_for_rollout(self, ranks: list[int] | None = None) -> dict:
        """Every rank (or ``ranks``) frees its grad buffers and (GPU) moves optimizer state and weights to
        host memory; returns the first called rank's bytes freed/moved per kind. Only ``Colocation``
        calls this."""
        return (await self._all("offload_for_rollout", ranks=ranks))[0]

    async def reload_for_training(self, ranks: list[int] | None = None) -> dict:
        """Bring back what :meth:`offload_for_rollout` moved, on every rank or ``ranks``. Only
        ``Colocation`` calls this."""
        return (await self._all("reload_for_training", ranks=ranks))[0]

    async def set_num_threads(self, n: int, ranks: list[int] | None = None) -> None:
        """torch intra-op threads on every rank or ``ranks`` (hand cores freed by the rollout to training)."""
        if n < 1:
            raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
        await self._all("set_num_threads", n, ranks=ranks)

    async def write_hf_weights(self, directory: str) -> None:
        """The policy as HF safetensors in ``directory`` (rank 0 writes after a gather)."""
        if not any(await self._all("write_hf_weights", directory)):
            raise RuntimeError("no trainer rank wrote the HF weights for the engine")

    async def write_rollout_shards(self, rollout_tp: int, directory: str, version: int,
                                   dtype: str = "float32") -> dict[str, float]:
        """The policy as per-rank shards for vLLM engines of TP ``rollout_tp`` in ``directory``,
        moved by the resharder (the engines' node must be rank 0's). Returns bytes
        sent/received/copied summed over ranks and the slowest rank's seconds and rounds."""
        per_rank = await self._all("write_rollout_shards", rollout_tp, directory, version, dtype)
        total = {k: sum(r[k] for r in per_rank) for k in ("bytes_sent", "bytes_received", "bytes_local")}
        total.update(seconds=max(r["seconds"] for r in per_rank), rounds=max(r["rounds"] for r in per_rank))
        return total

    async def rank_nodes(self) -> list[tuple[str, str]]:
        """(Ray node id, IP address) of every rank, in rank order."""
        return [tuple(x) for x in await self._all("node_address")]

    async def rank_gpus(self) -> list[str]:
        """GPU UUID of every rank ('' on CPU), in rank order."""
        return list(await self._all("gpu_uuid"))

    async def open_weight_push(self, spec: dict) -> list[dict]:
        """Set up a tensor weight push on every rank (``training.weight_push``); each rank's
        ring path, IPC handle and plan fingerprint, and rank 0's push-group port."""
        return await self._all("open_weight_push", spec)

    async def join_weight_push(self, key: str, port: int, group_ports: list[int] | None = None) -> None:
        """Every rank enters its push groups (the engines' workers join at the same time);
        ``group_ports``: the ports of the spec's groups, when it has some (GPU)."""
        await self._all("join_weight_push", key, port, *([group_ports] if group_ports is not None else []))

    async def push_weights(self, key: str, sync_id: int, version: int) -> dict[str, float]:
        """One push from every rank; bytes summed, seconds of the slowest rank."""
        per_rank = await self._all("push_weights", key, sync_id, version)
        total = {k: sum(r[k] for r in per_rank) for k in ("bytes", "net_bytes")}
        total.update({k: max(r[k] for r in per_rank) for k in ("pack_s", "wait_s", "net_s", "seconds")})
        return total

    async def close_weight_push(self, key: str) -> None:
        """Tear push ``key`` down on every rank."""
        await self._all("close_weight_push", key)

    async def rank0_node_id(self) -> str:
        """Ray node id of global rank 0 (where the weight directories are written)."""
        return (await self._all("node_id"))[0]

    async def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its part of a checkpoint into ``directory``."""
        await self._all("save_checkpoint", directory)

    async def load_checkpoint(self, directory: str) -> dict:
        """Every rank restores the step directory at the current layout, whatever layout saved it
        (MegatronWorker.load_checkpoint); returns rank 0's ``steps_done`` and, for dist
        checkpoints, ``saved_layout`` and ``rng_restored``."""
        return await self._first("load_checkpoint", directory)

    async def shutdown(self) -> None:
        """Tear the workers down and kill the actors (also when a rank fails). A broken group is
        not asked: its dead, stopped or blocked ranks would not answer; its actors are killed."""
        busy = [rank for rank, ref in self._in_flight.items() if ray.wait([ref], timeout=0)[1]]  # not finished
        try:
            if self.broken or busy:
                reason = self.broken or f"ranks {busy} still busy in an abandoned call"
                log.warning("trainer ranks killed without their teardown (%s)", reason)
            else:
                await wait_for(self._all("shutdown"), timeout=SHUTDOWN_TIMEOUT_S)
        except (asyncio.TimeoutError, TrainerRankError) as exc:
            log.warning("trainer ranks' teardown failed, killing them: %s", exc)
        finally:
            for a in self.actors:
                ray.kill(a)
            await self._reap()

    async def _reap(self, wait_s: float = 10.0) -> None:
        """Wait until the killed ranks of this machine are gone, so that the teardown's sweep of
        dead runs' /dev/shm directories (``train.py``) finds theirs (push rings); SIGKILL a rank
        still there then (a stopped process, SIGSTOP, cannot exit when Ray asks it to)."""
        import socket

        import psutil

        here = socket.gethostname()
        procs = []
        for rank in getattr(self, "_ranks", []):
            try:
                proc = psutil.Process(rank["pid"])
                if rank["host"] == here and abs(proc.create_time() - rank["started"]) < 1.0:
                    procs.append(proc)
            except psutil.Error:
                continue  # gone already
        # Stopped (SIGSTOP) ones cannot exit: no use waiting for them.
        stopped = [p for p in procs if _status(p) == psutil.STATUS_STOPPED]
        _, alive = await asyncio.to_thread(psutil.wait_procs, [p for p in procs if p not in stopped], timeout=wait_s)
        alive += stopped
        for proc in alive:
            log.warning("trainer rank process %d did not exit after its actor was killed: SIGKILL", proc.pid)
            try:
                proc.kill()
            except psutil.Error:
                pass
        await asyncio.to_thread(psutil.wait_procs, alive, timeout=wait_s)


def _status(proc) -> str:
    import psutil

    try:
        return proc.status()
    except psutil.Error:
        return ""

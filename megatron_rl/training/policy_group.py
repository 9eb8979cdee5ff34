"""Driver-side handle on the trainer ranks (Megatron workers hosted in Ray actors).

Every call goes to all ranks (SPMD: a collective called on only some ranks of a gloo group hangs)
and every ray.get has a timeout, so a dead rank is an error rather than a silent hang. The
``*_async`` variants await the ranks' ObjectRefs instead, so a driver running the rollout in an
asyncio loop keeps generating while the trainer works (RollPacker's stream trainer).
"""
from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

import ray

from megatron_rl.config import RunConfig
from megatron_rl.sample import Sample

CALL_TIMEOUT_S = float(os.environ.get("MEGATRON_RL_CALL_TIMEOUT_S", "1800"))


class TrainerRank:
    """Ray actor body: one Megatron rank. Heavy imports happen here, not on the driver."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int, device: str):
        import torch

        if device == "cpu":
            from megatron_rl.distributed.cpu_shim import apply_cpu_shim

            apply_cpu_shim()
            torch.set_num_threads(1)
        from megatron_rl.training.megatron_worker import MegatronWorker

        self.cfg = cfg
        self.device = device
        self.worker = MegatronWorker(cfg, rank, world_size, master_addr, master_port)

    def _call(self, name: str, *args, **kwargs):
        if self.device == "cpu":
            from megatron_rl.distributed.cpu_shim import cpu_device_mode

            # The device-rewriting mode is thread-local: enter it in the thread running the call.
            with cpu_device_mode():
                return getattr(self.worker, name)(*args, **kwargs)
        return getattr(self.worker, name)(*args, **kwargs)

    def load_hf(self, hf_path: str) -> None:
        return self._call("load_hf", hf_path)

    def compute_logprobs(self, samples: list[Sample], which: str) -> list[list[float]] | None:
        return self._call("compute_logprobs", samples, which)

    def _loss_fn(self):
        from megatron_rl.algorithms.losses import compute_policy_loss

        return functools.partial(compute_policy_loss, cfg=self.cfg.algorithm)

    def train_step(self, samples: list[Sample]) -> dict:
        return self._call("train_step", samples, self._loss_fn())

    def accumulate_gradients(self, samples: list[Sample]) -> dict:
        return self._call("accumulate_gradients", samples, self._loss_fn())

    def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict:
        return self._call("apply_accumulated_gradients", num_tokens_total, num_seqs_total)

    def discard_accumulated_gradients(self) -> None:
        return self._call("discard_accumulated_gradients")

    def offload_for_rollout(self) -> dict:
        return self._call("offload_for_rollout")

    def reload_for_training(self) -> dict:
        return self._call("reload_for_training")

    def set_num_threads(self, n: int) -> None:
        import torch

        # A sync actor runs every call on the same thread, so this reaches the compute thread.
        torch.set_num_threads(n)

    def write_hf_weights(self, directory: str) -> bool:
        """Gather the HF-named weights; rank 0 writes them as safetensors for the engine."""
        state = self._call("export_hf_state_dict")
        if state is None:
            return False
        from megatron_rl.rollout.weight_sync import write_hf_weights

        write_hf_weights(state, directory)
        return True

    def write_rollout_shards(self, rollout_tp: int, directory: str, version: int, dtype: str) -> dict:
        return self._call("write_rollout_shards", rollout_tp, directory, version, dtype)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save_checkpoint(self, directory: str) -> None:
        return self._call("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> dict:
        return self._call("load_checkpoint", directory)

    def shutdown(self) -> None:
        return self._call("shutdown")


class PolicyGroup:
    """All trainer ranks of the run; methods mirror MegatronWorker's and return rank 0's result."""

    def __init__(self, cfg: RunConfig, device: str, actor_options: dict, master_port: int):
        p = cfg.parallel
        self.world_size = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                           * p.context_parallel_size * p.data_parallel_size)
        remote_cls = ray.remote(TrainerRank)
        master_addr = "127.0.0.1" if cfg.cluster.num_nodes == 1 else ray.util.get_node_ip_address()
        self.actors = [
            remote_cls.options(**actor_options, name=None).remote(cfg, rank, self.world_size, master_addr,
                                                                  master_port, device)
            for rank in range(self.world_size)
        ]

    def _all(self, method: str, *args) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return ray.get(refs, timeout=CALL_TIMEOUT_S)

    async def _all_async(self, method: str, *args) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        try:
            return await asyncio.wait_for(asyncio.gather(*refs), timeout=CALL_TIMEOUT_S)
        except asyncio.TimeoutError as exc:  # same failure as ray.get's timeout in _all
            raise TimeoutError(f"trainer ranks did not finish {method} within {CALL_TIMEOUT_S:.0f}s") from exc

    def load_hf(self, hf_path: str) -> None:
        self._all("load_hf", hf_path)

    def compute_logprobs(self, samples: list[Sample], which: str = "policy") -> list[list[float]]:
        return self._all("compute_logprobs", samples, which)[0]

    async def compute_logprobs_async(self, samples: list[Sample], which: str = "policy") -> list[list[float]]:
        """:meth:`compute_logprobs` without blocking the caller's event loop."""
        return (await self._all_async("compute_logprobs", samples, which))[0]

    def train_step(self, samples: list[Sample]) -> dict:
        return self._all("train_step", samples)[0]

    def accumulate_gradients(self, samples: list[Sample]) -> dict:
        """Forward+backward of ``samples`` added to the pending step's gradient, no optimizer
        step (MegatronWorker.accumulate_gradients); returns the chunk's raw summed metrics."""
        return self._all("accumulate_gradients", samples)[0]

    async def accumulate_gradients_async(self, samples: list[Sample]) -> dict:
        """:meth:`accumulate_gradients` without blocking the caller's event loop."""
        return (await self._all_async("accumulate_gradients", samples))[0]

    def apply_accumulated_gradients(self, num_tokens_total: int, num_seqs_total: int) -> dict:
        """The one optimizer step over everything accumulated, normalised by the full batch's
        response tokens and sequences; metrics as :meth:`train_step` returns them."""
        return self._all("apply_accumulated_gradients", num_tokens_total, num_seqs_total)[0]

    async def apply_accumulated_gradients_async(self, num_tokens_total: int, num_seqs_total: int) -> dict:
        """:meth:`apply_accumulated_gradients` without blocking the caller's event loop."""
        return (await self._all_async("apply_accumulated_gradients", num_tokens_total, num_seqs_total))[0]

    def discard_accumulated_gradients(self) -> None:
        """Drop pending accumulated gradients (e.g. after a failed chunk) without a step."""
        self._all("discard_accumulated_gradients")

    def offload_for_rollout(self) -> dict:
        """``trainer.offload_during_rollout``: every rank frees its grad buffers and (GPU) moves
        optimizer state and weights to host memory (MegatronWorker.offload_for_rollout). Call
        after the weight sync; returns rank 0's bytes freed/moved per kind."""
        return self._all("offload_for_rollout")[0]

    def reload_for_training(self) -> dict:
        """Bring back what :meth:`offload_for_rollout` moved; call before the logprob pass."""
        return self._all("reload_for_training")[0]

    def set_num_threads(self, n: int) -> None:
        """torch intra-op threads on every rank (hand cores freed by the rollout to training)."""
        if n < 1:
            raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
        self._all("set_num_threads", n)

    def write_hf_weights(self, directory: str) -> None:
        if not any(self._all("write_hf_weights", directory)):
            raise RuntimeError("no trainer rank wrote the HF weights for the engine")

    async def write_rollout_shards_async(self, rollout_tp: int, directory: str, version: int,
                                         dtype: str = "float32") -> dict[str, float]:
        """The policy as per-rank shards for vLLM engines of TP ``rollout_tp`` in ``directory``,
        moved by the resharder (MegatronWorker.write_rollout_shards; the engines' node must be
        rank 0's). Returns bytes sent/received/copied summed over ranks and the slowest rank's
        seconds."""
        per_rank = await self._all_async("write_rollout_shards", rollout_tp, directory, version, dtype)
        total = {k: sum(r[k] for r in per_rank) for k in ("bytes_sent", "bytes_received", "bytes_local")}
        total.update(seconds=max(r["seconds"] for r in per_rank), rounds=max(r["rounds"] for r in per_rank))
        return total

    def rank0_node_id(self) -> str:
        """Ray node id of global rank 0 (where the weight directories are written)."""
        return ray.get(self.actors[0].node_id.remote(), timeout=CALL_TIMEOUT_S)

    def save_checkpoint(self, directory: str) -> None:
        self._all("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> dict:
        """Every rank restores the step directory at the current layout, whatever layout saved it
        (MegatronWorker.load_checkpoint); returns rank 0's ``steps_done`` and, for dist
        checkpoints, ``saved_layout`` and ``rng_restored``."""
        return self._all("load_checkpoint", directory)[0]

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            for a in self.actors:
                ray.kill(a)

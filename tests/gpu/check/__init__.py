"""A prepared check of what has never run on a GPU (``bash tests/gpu/run_on_device.sh``):
Megatron-Core on CUDA (bf16 vs fp32, activation recompute, the distributed optimizer, NCCL
groups), the trainer offload's memory moves, the planner's memory estimate against the
allocator, CUDA IPC between processes, and the decode / training speed figures the simulator
reads. ``--cpu`` runs the same parts with tiny sizes on CPU, so the script is tested between GPU
runs (``tests/integration/test_gpu_check_cpu_mode.py``).

Modules: ``harness`` (runner, table; torch-free), ``parts`` (the list), ``run_part`` (one part in
one process), ``forked`` (CPU mode: parts forked from one process that imported torch and
megatron-core), ``common`` (sizes, model, worker, comparisons), ``megatron_parts``,
``memory_parts``, ``ipc_part``, ``perf_parts``.
"""

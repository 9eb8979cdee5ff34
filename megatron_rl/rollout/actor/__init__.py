"""What runs in a rollout engine's own process (the Ray actor, or the process holding an in-process
engine) beside vLLM's AsyncLLM: :mod:`.vllm_engine` (the engine), its vLLM arguments and environment
(:mod:`.vllm_engine_args`, :mod:`.speculative`), the fork window its processes start in
(:mod:`.engine_start`), its stat logger (:mod:`.vllm_stats`), the CPU executor its engine-core
process runs (:mod:`.vllm_cpu_executor`) and the Ray actor body (:mod:`.engine_actor`).

The loop reaches this code only through the driver-side clients; nothing here imports them
(``.importlinter``)."""

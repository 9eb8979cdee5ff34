"""The core's benchmarks: each measures one part of the loop on the real stack, knows nothing of
RollPacker, and runs as ``megatron-rl-benchmark NAME [options]`` (:mod:`.cli`; ``NAME --help``
lists a benchmark's options) or ``python -m megatron_rl.benchmarks.<module>``.

* ``benchmark_weight_sync`` (``weight_sync``): hf files vs sharded files vs tensor push;
* ``benchmark_quantization`` (``quantization``): full-precision vs int8 rollout;
* ``benchmark_training``, ``benchmark_resharding``, ``benchmark_reward``, ``benchmark_checkpoint``:
  one part of the loop each (training steps, the trainer-to-engine resharder, the reward
  scheduler, checkpoint save and load);
* ``benchmark_engine_start``, ``benchmark_imports``: an engine's start-up, the imports of each
  kind of process;
* ``speculative_engine_check``: drafts off vs on, one engine;
* ``run_config`` (the run config of a loop run) and ``report`` (print a table, write its JSON):
  what they share; RollPacker's comparisons (``rollpacker.benchmarks``) import them from here;
* ``profiling/``: the loop profiler's parts (samplers, attribution, report, flame graphs) and
  ``profiling.command_cpu``, the CPU a command's processes use.
"""

"""RollPacker's benchmarks, simulator front-ends and profiling tools (console entry points in
pyproject.toml; the others run as ``python -m rollpacker.benchmarks.<module>``). The core's own
benchmarks (weight sync, quantization, training, resharding, rewards, checkpoints, engine start,
imports, the speculative engine check) and the profiler's parts live in ``megatron_rl.benchmarks``
(``megatron-rl-benchmark NAME``); RollPacker's import from there, never the reverse.

* ``benchmark`` (``rollpacker-benchmark``): baseline vs RollPacker on the real stack, and every
  other ``--compare``: its own two-run comparisons and, through one registry
  (``OWN_COMPARISONS``), ``benchmark_speculative``, ``benchmark_arms``, ``benchmark_peers`` and
  the core's ``weight_sync`` and ``quantization``;
* ``common``: what those share (the period arithmetic, the run options, table cells, the column
  runs; the run config itself is ``megatron_rl.benchmarks.run_config``); a leaf, so the dispatch
  and the benchmarks import it without a circle;
* ``profile_loop`` (``rollpacker-profile-loop``, with ``megatron_rl.benchmarks.profiling``): where
  the loop's time goes, column by column;
* ``plot_timeline`` (``rollpacker-plot-timeline``), ``rollout_profile`` (``rollpacker-rollout-profile``);
* ``simulate``, ``calibrate_simulator``, ``plan_cluster`` (``rollpacker-simulate``,
  ``rollpacker-calibrate-simulator``, ``rollpacker-plan-cluster``): the command lines of
  ``rollpacker.simulator`` and ``megatron_rl.planning``. They live here rather than in
  ``rollpacker/simulator/`` because they read recipes through the plug-in registry, which the
  simulator's own modules must stay free of (``.importlinter``).
"""

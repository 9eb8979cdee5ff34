"""RollPacker's benchmarks, simulator front-ends and profiling tools (console entry points in
pyproject.toml; the others run as ``python -m rollpacker.benchmarks.<module>``).

* ``benchmark`` (``rollpacker-benchmark``): baseline vs RollPacker on the real stack, and every
  other ``--compare``: its own two-run comparisons and, through one registry
  (``OWN_COMPARISONS``), ``benchmark_speculative``, ``benchmark_weight_sync``,
  ``benchmark_quantization`` and ``benchmark_arms``;
* ``common``: what those share (the run config, the period arithmetic, the run options, table
  cells); a leaf, so the dispatch and the benchmarks import it without a circle;
* ``benchmark_training``, ``benchmark_resharding``, ``benchmark_reward``, ``benchmark_checkpoint``:
  one part of the loop each;
* ``speculative_engine_check`` (``rollpacker-speculative-engine-check``): drafts off vs on, one engine;
* ``profile_loop`` (``rollpacker-profile-loop``) and ``profiling/``: where the loop's time goes;
* ``plot_timeline`` (``rollpacker-plot-timeline``), ``rollout_profile`` (``rollpacker-rollout-profile``);
* ``simulate``, ``calibrate_simulator``, ``plan_cluster`` (``rollpacker-simulate``,
  ``rollpacker-calibrate-simulator``, ``rollpacker-plan-cluster``): the command lines of
  ``rollpacker.simulator`` and ``megatron_rl.planning``. They live here rather than in
  ``rollpacker/simulator/`` because they read recipes through the plug-in registry, which the
  simulator's own modules must stay free of (``.importlinter``).
"""

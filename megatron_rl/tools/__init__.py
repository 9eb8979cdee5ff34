"""The core's command-line tools (console entry points in pyproject.toml; none imports RollPacker):

* ``convert_checkpoint`` (``megatron-rl-convert-checkpoint``): Hugging Face <-> Megatron dist checkpoints;
* ``make_tiny_model`` (``megatron-rl-make-tiny-model``): the tiny Qwen2.5-architecture model of the CPU runs;
* ``config_reference`` (``megatron-rl-config-reference``): the configuration reference in docs/configuration.md;
* ``plot_curves`` (``megatron-rl-plot-curves``): a run's training curves;
* ``grader_report`` / ``code_reward_report`` (``megatron-rl-grader-report`` /
  ``megatron-rl-code-reward-report``): the math grader's and the code sandbox's figures on the sets
  in tests/data;
* ``spawn_ranks``: the process launcher of the benchmarks that time gloo code (a library, no command).
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The source checkout, where the tools' defaults point (examples/, tests/data/, artifacts/, runs/).
The project is installed editable (``pip install -e .``, as tools/setup_env.sh does), so this is
the clone the package is imported from."""

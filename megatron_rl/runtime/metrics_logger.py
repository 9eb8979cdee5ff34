"""Training metrics: one JSON line per step, TensorBoard, W&B, a console progress bar, and the
small measurement helpers the loop uses to fill them (length stats, phase timer, occupancy).

Metric names are flat strings with '/' separating groups (nested dicts passed to
:meth:`MetricsLogger.log` are flattened the same way). The keys below are the ones the console
bar and ``megatron-rl-plot-curves`` look for; anything else is logged as is.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import string
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from megatron_rl.config.schema import TrainerConfig

REWARD_KEY = "reward/mean"
"""Mean shaped reward of the step's responses."""
ACCURACY_KEY = "reward/accuracy"
"""Fraction of the step's responses judged correct."""
VAL_PASS1_KEY = "val/pass@1"
"""Validation pass@1 (present only on validation steps)."""
RESPONSE_LENGTH_PREFIX = "response_length/"
"""Prefix of :func:`length_stats` output for response lengths (mean, p50, p90, max)."""
TIMING_PREFIX = "time/"
"""Prefix of :meth:`PhaseTimer.summary` output: one key per phase plus 'step' (wall time)."""
STEP_TIME_KEY = TIMING_PREFIX + "step"
"""Wall-clock seconds of the whole step."""
METRICS_FILE = "metrics.jsonl"


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into '/'-joined keys and turn numpy/torch scalars into python
    numbers; non-finite floats become None so the jsonl stays strict JSON."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, prefix=name + "/"))
            continue
        if hasattr(value, "item") and callable(value.item):  # numpy / torch 0-d values
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        flat[name] = value
    return flat


def _read_kept_lines(path: Path, start_step: float) -> list[str]:
    """Lines of an existing metrics file with step < start_step. A torn last line (the process
    was killed mid-write) is dropped; a malformed line elsewhere is an error."""
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a metrics record ({exc}): {line[:120]!r}") from exc
        if step < start_step:
            kept.append(line)
    return kept


def new_wandb_run_id() -> str:
    """A fresh W&B run id: 8 characters of [a-z0-9], the shape W&B generates itself (its
    ``wandb.util.generate_id`` helper was removed in wandb 0.2x, so the id is made here)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class MetricsLogger:
    """Fan one dict of scalars per step out to metrics.jsonl, TensorBoard, W&B and the console.

    ``start_step`` is the first step this process will log: records with ``step >= start_step``
    already in ``run_dir/metrics.jsonl`` (from a crashed or re-run attempt) are dropped, so a
    resumed run produces no duplicates and a fresh run (start_step=0) starts a fresh file.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: TrainerConfig,
        config_dict: Mapping[str, Any] | None = None,
        start_step: int = 0,
        total_steps: int | None = None,
    ) -> None:
        """``cfg``: the trainer section (outputs, sinks); ``config_dict``: the resolved run
        configuration, written to run_dir/config.json and given to W&B; ``total_steps``: length
        of the progress bar (default ``cfg.steps``)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.path = self.run_dir / METRICS_FILE
        self.start_step = start_step
        self.total_steps = cfg.steps if total_steps is None else total_steps
        if config_dict is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config_dict, indent=1, default=str))
        self._truncate(start_step)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: every record reaches the OS
        self._tb = self._open_tensorboard() if cfg.tensorboard else None
        self._wandb = self._open_wandb(config_dict) if cfg.wandb_project else None
        self._bar = self._open_progress_bar() if cfg.progress_bar else None

    def _truncate(self, start_step: int) -> None:
        if not self.path.exists():
            return
        kept = _read_kept_lines(self.path, start_step)
        # Rewrite via a temporary file so a crash here cannot lose the kept history.
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as handle:
            handle.write("".join(line + "\n" for line in kept))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)

    def _open_tensorboard(self):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events >= start_step left by the previous attempt of a resumed run.
        return SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=self.start_step or None)

    def _open_wandb(self, config_dict: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                f"trainer.wandb_project={self.cfg.wandb_project!r} needs the 'wandb' package "
                "(pip install wandb), or set trainer.wandb_project='' to disable W&B"
            ) from exc
        # Persist the run id so a resumed run continues the same W&B run.
        id_file = self.run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else new_wandb_run_id()
        if not id_file.is_file():
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(run_id)
            os.replace(tmp, id_file)  # a kill here leaves the old id or the new one, never half
        return wandb.init(
            project=self.cfg.wandb_project,
            mode=self.cfg.wandb_mode,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            config=dict(config_dict or {}),
        )

    def _open_progress_bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record the metrics of ``step`` everywhere; returns the flat record written.

        Every record starts with ``step`` (the argument wins over a 'step' metric) and ``time``
        (unix seconds)."""
        flat = flatten_metrics(metrics)
        record = {"step": int(step), "time": time.time()}
        record.update((k, v) for k, v in flat.items() if k not in record)
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        numeric = {
            key: value
            for key, value in record.items()
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._bar is not None:
            self._update_bar(step, numeric)
        return record

    def _update_bar(self, step: int, numeric: Mapping[str, float]) -> None:
        postfix = {}
        for label, key, fmt in (("reward", REWARD_KEY, ".3f"), ("acc", ACCURACY_KEY, ".2f"), ("step_s", STEP_TIME_KEY, ".1f")):
            if key in numeric:
                postfix[label] = format(numeric[key], fmt)
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(0, step + 1 - self._bar.n))

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir_or_file: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (given the file or its run directory), torn last line skipped."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return [json.loads(line) for line in _read_kept_lines(path, start_step=math.inf)]


def length_stats(lengths: Iterable[int | float], prefix: str = "") -> dict[str, float]:
    """Mean, median, 90th percentile and max of ``lengths`` (percentiles by linear
    interpolation, numpy's default), keys optionally prefixed (e.g. RESPONSE_LENGTH_PREFIX)."""
    import numpy as np

    values = np.asarray(list(lengths), dtype=np.float64)
    if values.size == 0:
        raise ValueError("length_stats needs at least one length")
    stats = {
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "max": float(values.max()),
    }
    return {prefix + key: value for key, value in stats.items()}


class PhaseTimer:
    """Stopwatch accumulating wall time per named phase within one step.

    Phases may run concurrently (reward scoring overlaps rollout), so their sum can exceed the
    step time; each phase name is timed at most once at a time. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget all phases and restart the step clock."""
        with self._lock:
            self._totals: dict[str, float] = {}
            self._running: dict[str, float] = {}
            self._intervals: list[tuple[str, float, float]] = []
            self._step_start = time.perf_counter()
            self.last_started = ""
            """The phase begun last (what an error report names as where the step was)."""

    def start(self, name: str) -> None:
        """Start timing ``name``."""
        with self._lock:
            if name in self._running:
                raise RuntimeError(f"timer phase {name!r} is already running")
            self._running[name] = time.perf_counter()
            self.last_started = name

    def stop(self, name: str) -> float:
        """Stop timing ``name``; returns the seconds of this interval."""
        with self._lock:
            if name not in self._running:
                raise RuntimeError(f"timer phase {name!r} was not started")
            start, end = self._running.pop(name), time.perf_counter()
            self._totals[name] = self._totals.get(name, 0.0) + end - start
            self._intervals.append((name, start, end))
            return end - start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with timer.phase("rollout"): ...`` (or ``with timer("rollout")``) adds the block's duration to ``rollout``."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    __call__ = phase  # ``with timer("train"): ...``

    def as_dict(self) -> dict[str, float]:
        """Accumulated seconds per finished phase."""
        with self._lock:
            return dict(self._totals)

    def intervals(self) -> list[tuple[str, float, float]]:
        """Every finished phase interval as (name, start, end) on the system-wide monotonic clock
        (``time.perf_counter`` is CLOCK_MONOTONIC on Linux), so a profiler in another process can
        line its samples up with the loop's phases."""
        with self._lock:
            return list(self._intervals)

    def summary(self, prefix: str = TIMING_PREFIX) -> dict[str, float]:
        """Phase totals plus 'step' (wall time since reset), keys prefixed for logging."""
        with self._lock:
            out = {prefix + name: total for name, total in self._totals.items()}
            out[prefix + "step"] = time.perf_counter() - self._step_start
        return out


Timer = PhaseTimer
"""Short alias of :class:`PhaseTimer`."""


def occupancy(intervals: Sequence[tuple[float, float]], capacity: int, window: tuple[float, float] | None = None) -> float:
    """Time-averaged fraction of the engine's ``capacity`` slots busy over ``window``.

    ``intervals`` are (start, end) per request; ``window`` defaults to (first start, last end).
    Intervals are clipped to the window. At any instant at most ``capacity`` requests run (the
    rest wait in the engine queue), so the busy-slot count is min(active, capacity); a sweep over
    the sorted start/end events integrates it exactly. Returns a value in [0, 1].
    """
    if capacity <= 0:
        raise ValueError(f"occupancy capacity must be > 0, got {capacity}")
    for index, (start, end) in enumerate(intervals):
        if end < start:
            raise ValueError(f"occupancy interval {index} ends before it starts: ({start}, {end})")
    if window is None:
        if not intervals:
            return 0.0
        window = (min(s for s, _ in intervals), max(e for _, e in intervals))
        if window[1] == window[0]:
            return 0.0  # only zero-length requests: nothing ever occupied a slot
    lo, hi = window
    if hi <= lo:
        raise ValueError(f"occupancy window must have end > start, got {window}")
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        start, end = max(start, lo), min(end, hi)
        if end > start:
            events.append((start, 1))
            events.append((end, -1))
    # Ends sort before starts at equal times; it does not change the integral, only the order.
    events.sort()
    busy_time = 0.0
    active = 0
    previous = lo
    for t, delta in events:
        busy_time += min(active, capacity) * (t - previous)
        active += delta
        previous = t
    return busy_time / (capacity * (hi - lo))


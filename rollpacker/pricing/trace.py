"""Reading a run's engine-step trace (``run_dir/engine_trace.jsonl``), its config and metrics.

Every line is checked before anything is priced: a bad line fails with ``file:line`` and the
key at fault. ``engine`` lines hold the iterations one engine ran since the previous drain
(drained right after step S's rollout); ``batch`` lines hold the samples trained at step S. A
step without a ``batch`` line takes its trained samples' lengths from ``trained_prompts.jsonl``
(its ``lengths``: [prompt, response] tokens per trained sample), which every run writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TRACE_FILE = "engine_trace.jsonl"
TRAINED_FILE = "trained_prompts.jsonl"
COLUMNS = ("t", "elapsed_ms", "running", "waiting", "prefill_tokens", "decode_tokens", "context_tokens",
           "drafted", "accepted", "preempted", "version")
"""The columns pricing reads; a trace may carry more (ignored)."""


class TraceError(ValueError):
    """A run directory or trace line that cannot be priced; the message names file:line and key."""


@dataclass(frozen=True)
class EngineBlock:
    """The iterations one engine ran between two drains; ``rows`` maps column -> values."""

    step: int
    round: str
    engine: int
    tp: int
    max_num_seqs: int
    kv_capacity_tokens: int
    rows: dict[str, list[float]]

    @property
    def iterations(self) -> int:
        return len(self.rows["t"])


@dataclass(frozen=True)
class Batch:
    """The samples trained at ``step``: prompt and response lengths, one entry per sample."""

    step: int
    round: str
    prompt_tokens: list[int]
    response_tokens: list[int]


@dataclass
class RunTrace:
    """One run: its config (config.json), metrics rows by step, engine blocks and batches."""

    run_dir: Path
    config: dict
    metrics: dict[int, dict] = field(default_factory=dict)
    blocks: list[EngineBlock] = field(default_factory=list)
    batches: dict[int, Batch] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.batches) | {b.step for b in self.blocks})

    def blocks_of(self, step: int) -> list[EngineBlock]:
        return [b for b in self.blocks if b.step == step]


def _require(obj: dict, key: str, typ: type | tuple, where: str):
    if key not in obj:
        raise TraceError(f"{where}: missing key '{key}'")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, typ):
        raise TraceError(f"{where}: key '{key}' must be {getattr(typ, '__name__', typ)}, got {value!r}"[:300])
    return value


def _int_list(obj: dict, key: str, where: str) -> list[int]:
    values = _require(obj, key, list, where)
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"{where}: key '{key}'[{i}] must be a non-negative integer, got {v!r}")
    return values


def _engine_block(obj: dict, where: str) -> EngineBlock:
    # A run of one engine that is not a pool tags no engine index: it is engine 0.
    ints = {k: _require({"engine": 0, **obj}, k, int, where)
            for k in ("step", "engine", "tp", "max_num_seqs", "kv_capacity_tokens")}
    columns = _require(obj, "columns", list, where)
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise TraceError(f"{where}: key 'columns' lacks {missing}")
    rows = _require(obj, "rows", list, where)
    data: dict[str, list[float]] = {c: [] for c in COLUMNS}
    index = [columns.index(c) for c in COLUMNS]
    for r, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            raise TraceError(f"{where}: key 'rows'[{r}] must be a list of {len(columns)} values (the columns)")
        for c, i in zip(COLUMNS, index):
            v = row[i]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TraceError(f"{where}: key 'rows'[{r}] column '{c}' must be a number, got {v!r}")
            data[c].append(float(v))
    return EngineBlock(ints["step"], _require(obj, "round", str, where), ints["engine"], ints["tp"],
                       ints["max_num_seqs"], ints["kv_capacity_tokens"], data)


def _batch(obj: dict, where: str) -> Batch:
    prompts, responses = _int_list(obj, "prompt_tokens", where), _int_list(obj, "response_tokens", where)
    if len(prompts) != len(responses):
        raise TraceError(f"{where}: key 'response_tokens' has {len(responses)} entries, 'prompt_tokens' {len(prompts)}")
    return Batch(_require(obj, "step", int, where), _require(obj, "round", str, where), prompts, responses)


def read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """(``file:line``, object) of every non-empty line; a missing file or bad JSON fails naming it."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a line must be a JSON object")
        out.append((where, obj))
    return out


def read_trace(run_dir: str | Path) -> RunTrace:
    """The run at ``run_dir``: config.json, metrics.jsonl and engine_trace.jsonl, all checked."""
    d = Path(run_dir)
    if not d.is_dir():
        raise TraceError(f"{d}: not a run directory")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise TraceError(f"{cfg_path}: no such file (the run's configuration)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{cfg_path}: invalid JSON ({exc.msg})") from None
    run = RunTrace(d, config)
    for where, obj in read_jsonl(d / "metrics.jsonl"):
        run.metrics[_require(obj, "step", int, where)] = obj
    trace_path = d / TRACE_FILE
    if not trace_path.is_file():
        raise TraceError(f"{trace_path}: no such file: the run recorded no engine-step trace "
                         "(runs before traces existed, or a run with the trace turned off)")
    for where, obj in read_jsonl(trace_path):
        kind = obj.get("kind")
        if kind == "engine":
            run.blocks.append(_engine_block(obj, where))
        elif kind == "batch":
            batch = _batch(obj, where)
            if batch.step in run.batches:
                raise TraceError(f"{where}: key 'step': a second batch line for step {batch.step}")
            run.batches[batch.step] = batch
        else:
            raise TraceError(f"{where}: key 'kind' must be 'engine' or 'batch', got {kind!r}")
    if not run.blocks:
        raise TraceError(f"{trace_path}: no engine lines")
    trained = d / TRAINED_FILE
    if trained.is_file():
        for where, obj in read_jsonl(trained):
            step = _require(obj, "step", int, where)
            if step in run.batches or "lengths" not in obj:
                continue
            pairs = _require(obj, "lengths", list, where)
            if any(not isinstance(p, list) or len(p) != 2 for p in pairs):
                raise TraceError(f"{where}: key 'lengths' must hold [prompt, response] pairs")
            flat = {"prompt_tokens": [p[0] for p in pairs], "response_tokens": [p[1] for p in pairs]}
            round_type = next((b.round for b in run.blocks if b.step == step), "")
            run.batches[step] = Batch(step, round_type, _int_list(flat, "prompt_tokens", f"{where} (lengths)"),
                                      _int_list(flat, "response_tokens", f"{where} (lengths)"))
    return run

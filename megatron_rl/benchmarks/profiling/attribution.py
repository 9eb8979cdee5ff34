"""Attribute what :mod:`megatron_rl.benchmarks.profiling.sampling` saw to the loop's phases and to what each
process was doing (pure functions over files: tested without a run).

* **Phases** come from the run's ``phases.jsonl`` (the trainer writes every phase's start and
  end on the system-wide monotonic clock): ``rollout/<round type>``, ``scoring`` (old-logprob
  forward), ``train``, ``weight_sync``, ``validation``, ``checkpoint``, and ``between phases``
  (the loop's own glue inside the run window).
* **CPU seconds per phase** of a process: its cumulative CPU time (the kernel's accounting) cut
  at the phase boundaries, each sampling interval's CPU spread evenly over it.
* **What a process was doing**: py-spy's Chrome trace (with ``--idle``, a thread's stack is known
  at every sample) turned into (start, end, stack) intervals per thread; a stack is idle when its
  innermost Python frame is a known blocking call (poll, wait, select, the Ray task loop), else it
  is put in the first category of the process's role whose pattern one of its frames contains.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PHASE_NAMES = {"rollout": "rollout", "logprob": "scoring", "train": "train", "weight_sync": "weight_sync",
               "validation": "validation", "checkpoint": "checkpoint"}
BETWEEN = "between phases"


@dataclass(frozen=True)
class Phase:
    step: int
    round_type: str
    label: str
    start: float
    end: float


def read_phases(run_dir: str | Path) -> list[Phase]:
    """Every phase of the run, in time order (``rollout`` labelled with its round type)."""
    phases = []
    for line in (Path(run_dir) / "phases.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        for name, start, end in rec["phases"]:
            label = PHASE_NAMES.get(name, name)
            if label == "rollout":
                label = f"rollout/{rec['round_type']}"
            phases.append(Phase(rec["step"], rec["round_type"], label, float(start), float(end)))
    return sorted(phases, key=lambda p: p.start)


def loop_window(phases: list[Phase]) -> tuple[float, float]:
    """From the first phase's start to the last one's end (start-up and teardown excluded)."""
    return min(p.start for p in phases), max(p.end for p in phases)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def split_by_phase(t0: float, t1: float, amount: float, phases: list[Phase], window: tuple[float, float],
                   into: dict[str, float]) -> None:
    """Add ``amount``, spread evenly over [t0, t1], to the phases it overlaps (and to
    :data:`BETWEEN` for the part inside the window that no phase covers)."""
    span = t1 - t0
    if span <= 0 or amount == 0:
        return
    inside = _overlap(t0, t1, *window)
    if inside <= 0:
        return
    covered = 0.0
    for p in phases:
        if p.end <= t0:
            continue
        if p.start >= t1:
            break
        part = _overlap(t0, t1, p.start, p.end)
        if part > 0:
            into[p.label] = into.get(p.label, 0.0) + amount * part / span
            covered += part
    if inside - covered > 1e-9:
        into[BETWEEN] = into.get(BETWEEN, 0.0) + amount * (inside - covered) / span


def phase_cpu(samples: list[tuple[float, float]], phases: list[Phase]) -> dict[str, float]:
    """CPU seconds per phase from cumulative (time, CPU seconds) samples."""
    window = loop_window(phases)
    out: dict[str, float] = {}
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        split_by_phase(t0, t1, c1 - c0, phases, window, out)
    return out


def phase_wall(phases: list[Phase]) -> dict[str, float]:
    """Wall seconds per phase label over the run, with :data:`BETWEEN` for the glue."""
    out: dict[str, float] = defaultdict(float)
    for p in phases:
        out[p.label] += p.end - p.start
    start, end = loop_window(phases)
    out[BETWEEN] = max(0.0, (end - start) - sum(out.values()))
    return dict(out)


# ---------------------------------------------------------------------------- py-spy traces
def spy_intervals(trace: str | Path, started: float) -> dict[int, list[tuple[float, float, tuple[str, ...]]]]:
    """Per thread, the (start, end, stack) intervals of a py-spy Chrome trace, on the monotonic
    clock (py-spy counts microseconds from its own start, ``started``). Stacks run outermost
    first, without py-spy's ``process ...`` frames."""
    events = json.loads(Path(trace).read_text())
    per_thread: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        per_thread[e["tid"]].append(e)
    out: dict[int, list[tuple[float, float, tuple[str, ...]]]] = {}
    for tid, evs in per_thread.items():
        stack: list[str] = []
        intervals = []
        last = None
        for e in evs:  # py-spy writes them in time order
            ts = started + e["ts"] / 1e6
            if last is not None and ts > last and stack:
                frames = tuple(f for f in stack if not f.startswith("process "))
                if frames:
                    intervals.append((last, ts, frames))
            last = ts
            if e["ph"] == "B":
                stack.append(e["name"])
            elif stack:
                stack.pop()
        out[tid] = intervals
    return out


IDLE_LEAVES = (
    "Poller.poll", "Condition.wait", "Event.wait", "_PollLikeSelector.select", "EpollSelector.select",
    "Selector.select", "select", "Queue.get", "Worker.main_loop", "Connection._recv", "Thread.join",
    "Thread._wait_for_tstate_lock", "Popen.communicate", "Popen._wait", "Popen.wait", "Socket.recv",
    "Socket.recv_multipart", "sleep", "BaseEventLoop.run_forever", "wait", "SimpleQueue.get", "Lock.acquire",
    "_recv", "recv_bytes", "Future.result", "poll", "Worker.print_logs", "listen_error_messages", "Thread.run",
)
"""Innermost Python frames that block (the thread is asleep in C below them)."""


def is_idle(stack: tuple[str, ...]) -> bool:
    leaf = stack[-1].split(" (", 1)[0]
    return leaf in IDLE_LEAVES or leaf.endswith((".wait", ".poll", ".select", "._recv"))


_ENGINE = [
    # First: with the mp executor the engine core waits for its worker inside frames that are
    # named like the work (execute_model, sample_tokens).
    ("spin-wait (shared-memory hand-off)", ("sched_yield", "SpinCondition", "acquire_read", "memory_fence",
                                            "MessageQueue", "enqueue_output", "FutureWrapper")),
    ("drafting (proposer)", ("SpecDrafter", "propose_draft_token_ids", "NgramProposer", "SuffixIndex")),
    ("verification (rejection sampling)", ("RejectionSampler", "rejection_sample", "expand_batch_to_tokens",
                                           "_calc_spec_decode_metadata")),
    ("sampling", ("Sampler.", "TopKTopPSampler", "GPUModelRunner._sample", "compute_logprobs", "gather_logprobs")),
    ("model forward", ("Qwen2ForCausalLM", "_model_forward", "LogitsProcessor", "compute_logits")),
    ("input preparation", ("_prepare_inputs", "_build_attention_metadata", "_preprocess", "_update_states",
                           "commit_block_table", "_prepare_input")),
    ("output bookkeeping", ("_bookkeeping_sync", "sample_tokens", "ModelRunnerOutput")),
    ("weight load", ("reload_weights", "load_weights", "load_rank_shards", "reload_quantized", "weight_transfer",
                     "update_weights", "receive_weights")),
    ("scheduling", ("Scheduler.schedule", "Scheduler.update_from_output", "KVCacheManager", "post_step",
                    "update_draft_token_ids", "take_draft_token_ids", "make_stats")),
    ("outputs to the front-end", ("process_output_sockets", "MsgpackEncoder", "_send_msg")),
    ("requests in", ("process_input_sockets", "_handle_client_request", "preprocess_add_request", "add_request",
                     "abort_requests")),
]
"""The engine's categories: the same rules for the engine-core process (which runs the model
itself with the in-process executor) and vLLM's worker process (the ``mp`` executor)."""

# Per role: (category, substrings of frames), first match wins; "other" when none matches.
CATEGORIES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "engine worker": _ENGINE,
    "engine core": _ENGINE,
    "engine front-end": [
        ("output processing", ("OutputProcessor", "process_outputs", "RequestOutputCollector")),
        ("requests (add/abort)", ("add_request", "abort", "InputProcessor", "process_inputs")),
        ("engine client I/O", ("get_output_async", "output_handler", "AsyncMPClient", "zmq", "msgpack")),
        ("weight push", ("weight", "push", "reload")),
        ("loop adapter (VLLMEngine)", ("VLLMEngine", "vllm_engine", "ray_engine", "EngineActor", "engine_actor")),
        ("ray", ("ray/", "ray.")),
    ],
    "driver": [
        ("rollout scheduler", ("tail_batching", "baseline.py", "requests.py", "next_batch", "history")),
        ("rewards", ("reward", "RewardPool")),
        ("engine client", ("ray_engine", "EngineClient", "engine_pool")),
        ("trainer calls", ("PolicyGroup", "policy_group")),
        ("weight sync", ("weight_sync/", "weight_push", "WeightSync", "push_")),
        ("profiler (this tool)", ("ProcessSampler", "SpyRecorders", "psutil")),
        ("metrics and logs", ("metrics", "MetricsLogger", "tqdm", "step_log", "step_record")),
        ("ray", ("ray/", "ray.")),
        ("event loop", ("asyncio", "events.py", "base_events", "selector_events")),
    ],
    "trainer rank": [
        ("scoring (old-logprob forward)", ("compute_logprobs",)),
        ("checkpoint", ("save_checkpoint", "dist_checkpointing", "load_checkpoint")),
        ("weight sync", ("export_hf", "write_hf", "weight_push", "weight_sync/", "stage_")),
        ("optimizer step", ("megatron/core/optimizer", "Optimizer", "step_with_ready_grads", "Adam", "optimizer.py")),
        ("gradient sync", ("finish_grad_sync", "start_grad_sync", "all_reduce", "grad_buffer")),
        ("backward", ("_engine_run_backward", "backward_step", "Tensor.backward", "Function.backward", "backward (")),
        ("forward", ("forward_step", "GPTModel.forward", "TransformerBlock", "forward (")),
        ("ray", ("ray/",)),
    ],
    "reward worker": [
        ("grading (math-verify)", ("math_verify", "math_grader", "grade", "verify", "parse")),
        ("isolated call", ("isolated_call",)),
        ("ray", ("ray/",)),
    ],
}


def category(role: str, stack: tuple[str, ...]) -> str:
    """What an active stack of a process of ``role`` was doing."""
    for name, patterns in CATEGORIES.get(role, []):
        if any(p in frame for frame in stack for p in patterns):
            return name
    return "other"


def main_thread(intervals: dict[int, list[tuple[float, float, tuple[str, ...]]]]) -> int | None:
    """The py-spy thread id of the process's main thread: the one whose stacks start at a
    module's top level (other threads start in ``Thread._bootstrap``)."""
    best, best_time = None, 0.0
    for tid, thread in intervals.items():
        top = sum(t1 - t0 for t0, t1, stack in thread if stack[0].startswith("<module>"))
        if top > best_time:
            best, best_time = tid, top
    return best


def attribute_cpu(samples: list[tuple[float, float]], intervals: list[tuple[float, float, tuple[str, ...]]],
                  role: str, phases: list[Phase]) -> dict[str, dict[str, float]]:
    """phase label -> category -> CPU seconds of one thread: the kernel's CPU time of each
    sampling window (``samples``: cumulative), shared among the categories of the active stacks
    py-spy saw in that window in proportion to their time; a window with CPU but only idle stacks
    counts as ``unattributed``."""
    window = loop_window(phases)
    out: dict[str, dict[str, float]] = defaultdict(dict)
    i = 0
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        cpu = c1 - c0
        if cpu <= 0 or t1 <= t0:
            continue
        while i < len(intervals) and intervals[i][1] <= t0:
            i += 1
        seen: dict[str, float] = {}
        j = i
        while j < len(intervals) and intervals[j][0] < t1:
            a, b, stack = intervals[j]
            part = _overlap(a, b, t0, t1)
            if part > 0 and not is_idle(stack):
                name = category(role, stack)
                seen[name] = seen.get(name, 0.0) + part
            j += 1
        total = sum(seen.values())
        shares = {k: v / total for k, v in seen.items()} if total > 0 else {"unattributed": 1.0}
        per_phase: dict[str, float] = {}
        split_by_phase(t0, t1, cpu, phases, window, per_phase)
        for label, seconds in per_phase.items():
            for name, share in shares.items():
                out[label][name] = out[label].get(name, 0.0) + seconds * share
    return dict(out)


def collapsed_stacks(intervals: dict[int, list[tuple[float, float, tuple[str, ...]]]], phases: list[Phase],
                     labels: set[str]) -> dict[tuple[str, ...], float]:
    """Seconds per active stack inside the phases named in ``labels`` (for a flame graph)."""
    selected = [p for p in phases if p.label in labels]
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for thread in intervals.values():
        for t0, t1, stack in thread:
            if is_idle(stack):
                continue
            for p in selected:
                part = _overlap(t0, t1, p.start, p.end)
                if part > 0:
                    out[stack] += part
    return dict(out)

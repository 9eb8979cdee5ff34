"""Event-driven simulation of one continuous-batching engine (vLLM V1 semantics).

Between two events (a sequence finishes, the KV cache fills, a request arrives, the stop time)
the batch is fixed, so the time of k decode iterations has a closed form and the simulation
jumps from event to event instead of stepping every token; a 32k-token round costs a few
thousand events, not millions.

Scheduling as in vLLM: FCFS admission while fewer than ``max_num_seqs`` run and the KV cache
holds the request's context plus one token per running sequence; when a running sequence needs a KV slot and none is free, the most
recently admitted sequence is preempted (its KV freed; it re-enters the queue front and pays a
prefill of prompt + generated tokens when readmitted).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollpacker.simulator.engine_model import EngineModel


@dataclass
class SimRequest:
    """One response being generated."""

    rid: int
    prompt_tokens: int
    target_tokens: int
    """Response length it will reach (already capped at max_new_tokens)."""
    pid: int = -1
    """Prompt (group) the response belongs to."""
    generated: int = 0
    arrival: float = 0.0
    finish: float | None = None
    preemptions: int = 0

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated


@dataclass
class EngineRun:
    """What happened on one engine."""

    finished: list[SimRequest] = field(default_factory=list)
    unfinished: list[SimRequest] = field(default_factory=list)
    """Requests still queued or running at ``stop_at`` (with their generated counts)."""
    busy_until: float = 0.0
    busy_s: float = 0.0
    preemptions: int = 0
    tokens: int = 0


def simulate_engine(model: EngineModel, requests: list[SimRequest], start: float = 0.0,
                    stop_at: float | None = None) -> EngineRun:
    """Run ``requests`` (admitted no earlier than their ``arrival``) on one engine from ``start``."""
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
    waiting: deque[SimRequest] = deque()
    running: list[SimRequest] = []
    ctx: dict[int, int] = {}  # rid -> tokens in KV
    out = EngineRun()
    t = start
    for r in requests:
        if r.prompt_tokens + r.target_tokens > model.kv_capacity_tokens:
            raise ValueError(f"request {r.rid}: {r.prompt_tokens + r.target_tokens} tokens exceed the engine's KV "
                             f"capacity of {model.kv_capacity_tokens} tokens")
    while pending or waiting or running:
        if stop_at is not None and t >= stop_at:
            break
        while pending and pending[0].arrival <= t:
            waiting.append(pending.popleft())
        # Admission (FCFS): prefill of prompt + already generated tokens (re-prefill after preemption).
        used = sum(ctx.values())
        prefill = 0
        while waiting and len(running) < model.max_num_seqs:
            r = waiting[0]
            need = r.prompt_tokens + r.generated
            # Room for its context and one more token for every sequence of the grown batch,
            # so an admitted request always decodes at least once (no admit/preempt livelock).
            if used + need + len(running) + 1 > model.kv_capacity_tokens:
                break
            waiting.popleft()
            running.append(r)
            ctx[r.rid] = need
            used += need
            prefill += need
        if prefill:
            dt = prefill * model.prefill_token_s
            t += dt
            out.busy_s += dt
        if not running:
            if not pending:
                break
            t = max(t, pending[0].arrival)  # idle until the next arrival
            continue
        batch, free = len(running), model.kv_capacity_tokens - used
        if free < batch:  # no KV slot for every sequence's next token: preempt the newest
            victim = running.pop()
            del ctx[victim.rid]
            victim.preemptions += 1
            out.preemptions += 1
            waiting.appendleft(victim)
            continue
        k = min(min(r.remaining for r in running), free // batch)
        events = [x for x in (stop_at, pending[0].arrival if pending else None) if x is not None]
        if events:
            horizon = min(events)
            k = min(k, _iterations_before(model, batch, used, horizon - t))
        dt = model.decode_time(batch, used, k)
        t += dt
        out.busy_s += dt
        out.tokens += k * batch
        still = []
        for r in running:
            r.generated += k
            ctx[r.rid] += k
            if r.remaining <= 0:
                r.finish = t
                del ctx[r.rid]
                out.finished.append(r)
            else:
                still.append(r)
        running = still
    out.busy_until = t
    out.unfinished = running + list(waiting) + list(pending)
    return out


def _iterations_before(model: EngineModel, batch: int, ctx: int, budget: float) -> int:
    """Iterations that end within ``budget`` seconds (at least 1 so time always advances)."""
    lo, hi = 1, 1
    while model.decode_time(batch, ctx, hi) < budget:
        hi *= 2
    while lo < hi:  # smallest k whose end reaches the horizon
        mid = (lo + hi) // 2
        if model.decode_time(batch, ctx, mid) >= budget:
            hi = mid
        else:
            lo = mid + 1
    return max(1, lo)

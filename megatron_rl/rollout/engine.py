"""The rollout engine contract every scheduler talks to.

One request per response: each has its own id, token budget and seed, so a scheduler can abort
any single response. Completions arrive as a stream, in finish order. Implementations: the vLLM
backend (``vllm_engine.VLLMEngine``), its Ray client and actor (``ray_engine``), the pool
(``engine_pool``), the wrappers over another engine (``engine_wrapper.ForwardingEngine``: elastic
TP), and in tests a fake engine for pure scheduling logic. :data:`ENGINE_CONTRACT`
lists the members; this module imports nothing of Ray, vLLM or torch (``.importlinter``).
"""
from __future__ import annotations

import abc
import asyncio
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import AsyncIterator, Awaitable, Callable, ClassVar, Literal, Mapping


@dataclass
class GenerationRequest:
    request_id: str
    """Unique id; used to abort and to match the completion."""
    prompt_ids: list[int]
    """Prompt tokens (already templated)."""
    max_tokens: int
    """Budget for this response (resumed requests get budget - already generated)."""
    seed: int
    """Per-request sampling seed (reproducible rollouts)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus threshold."""
    return_logprobs: bool = True
    """Return the sampled token's logprob per step."""
    speculate: bool = False
    """Let the engine draft tokens for this request (engines built with a
    ``rollout.speculative.method``; others ignore it). Lossless: drafts only decide how many tokens
    one decode step verifies, never which tokens are sampled."""
    draft_group: str = ""
    """Requests with the same non-empty group (one prompt's responses in one round) draft from
    each other's tokens, running or finished ('suffix' method)."""
    draft_references: list[list[int]] = field(default_factory=list)
    """Earlier responses of the same prompt (e.g. previous epochs), newest first: more text the
    'suffix' drafter may copy continuations from."""


@dataclass
class Completion:
    request_id: str
    """Id of the request this finishes."""
    token_ids: list[int]
    """Generated tokens (for an abort: the partial tokens)."""
    logprobs: list[float]
    """Logprob of each generated token under the engine's weights (empty if not requested)."""
    finish_reason: str
    """'stop' (EOS/stop token), 'length' (budget used up) or 'abort'."""
    weight_version: int
    """Engine weight version that generated the tokens (set by reload_weights)."""
    submit_time: float = 0.0
    """time.monotonic() when the request was submitted."""
    finish_time: float = 0.0
    """time.monotonic() when it finished."""


@dataclass
class EngineStats:
    running: int = 0
    """Requests decoding now."""
    waiting: int = 0
    """Requests queued (not yet scheduled)."""
    preemptions: int = 0
    """Cumulative preemptions (KV cache ran out) since the engine started."""
    kv_cache_usage: float = 0.0
    """Fraction of KV cache blocks in use (0..1)."""
    capacity: int = 0
    """Most sequences the engine decodes at once (max_num_seqs)."""
    decode_steps: int = 0
    """Cumulative engine steps that generated tokens (one step verifies every running request's
    drafts at once, so speculation shows as fewer steps for the same tokens)."""
    drafts: int = 0
    """Cumulative request-steps that carried draft tokens (speculative decoding)."""
    draft_tokens: int = 0
    """Cumulative draft tokens proposed."""
    accepted_tokens: int = 0
    """Cumulative draft tokens the target model accepted (each saves one decode step)."""
    restarts: int = 0
    """Engines replaced after they died, in the run so far (a supervised pool; every pool the run's
    engine factory builds shares one count, so it survives elastic TP switches)."""
    restart_s: float = 0.0
    """Seconds from noticing each death until its replacement was up, summed over the run."""
    resubmitted: int = 0
    """Requests moved off dead engines and continued elsewhere, in the run so far."""
    extra: dict = field(default_factory=dict)
    """Backend-specific numbers."""


CUMULATIVE_COUNTERS = ("preemptions", "decode_steps", "drafts", "draft_tokens", "accepted_tokens")
"""EngineStats fields that only grow over an engine's life: pools sum them, wrappers that rebuild
engines carry the shut-down engines' counts forward, consumers diff them across a round."""


class CapabilityAbsent(NotImplementedError):
    """An optional capability this engine or transport does not offer (e.g. the tensor weight
    push on an engine without a receiver). A deliberate answer of the contract, not missing code:
    the caller picks another path (``rollout.weight_sync_format=sharded``). A subclass of
    NotImplementedError, so code that catches that keeps working."""


class RolloutEngine(abc.ABC):
    """Async engine interface. All methods run on one event loop; every public method and property
    is a member of the contract (:data:`ENGINE_CONTRACT`), each docstring its contract."""

    keeps_defaults: ClassVar[frozenset[str]] = frozenset()
    """Contract members with a default here that a subclass keeps on purpose instead of answering
    them itself (e.g. :data:`SINGLE_ENGINE_DEFAULTS`); tests/unit/test_engine_contract.py holds
    every implementation to answering the rest."""

    @abc.abstractmethod
    async def submit(self, request: GenerationRequest) -> None:
        """Queue a request; returns at once. Its completion appears in ``completions()``."""

    async def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Queue these requests as one launch: none is scheduled before the engine holds them all
        (a pool places them all first, by its own counts), so a round's first iterations and its
        placement depend on its requests, not on how fast each submit returned. Errors as
        :meth:`submit`. The default (an engine with no scheduler to hold) submits them in order."""
        for request in requests:
            await self.submit(request)

    @abc.abstractmethod
    def completions(self) -> AsyncIterator[Completion]:
        """Async iterator over completions in finish order (aborted ones included, with
        finish_reason 'abort'). Runs until the engine is shut down."""

    @abc.abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests now. Each still yields one Completion with reason 'abort'
        (unless it had already finished). Unknown ids are ignored."""

    @abc.abstractmethod
    async def reload_weights(self, weights_dir: str, version: int) -> dict[str, float] | None:
        """Load HF-named safetensors from ``weights_dir`` in place and tag later completions
        with ``version``. Must not be called with requests in flight. Returns the load's figures
        (``engine_s``, ...) where the engine measures them, else None."""

    async def sleep(self, level: int = 1) -> None:
        """Release the engine's device memory so another job (the trainer) can use it.

        Must only be called with no requests in flight (finish or abort them first). While
        asleep the engine accepts no requests and no weight reload; :meth:`wake_up` undoes it.
        Frees what the backend can (weights and KV cache); the default frees nothing, so an
        engine without a sleep mode still works, it just holds its memory. Idempotent.
        ``level`` 1 keeps the weights (in host memory); 2 discards them: the engine then needs a
        weight push or reload before it serves again (use it only when one follows).
        """

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Reacquire what :meth:`sleep` released; the engine then serves requests again with the
        weights it had (reload afterwards to move to newer ones). No-op when awake. ``tags``
        ``["weights"]`` wakes only the weights (a push or reload may run, no requests yet),
        ``["kv_cache"]`` the rest; None wakes everything."""

    @property
    @abc.abstractmethod
    def tensor_parallel_size(self) -> int:
        """The TP size of this engine's model shards (every engine of a pool has the same): the
        layout weights must be written in for it."""

    @property
    def active_engines(self) -> int:
        """Engines now generating: 1 for a single engine; a pool counts those not released."""
        return 1

    async def release_engines(self, count: int, members: list[int] | None = None, level: int = 1) -> dict[str, float]:
        """Hand ``count`` whole engines to the trainer (a pool, see ``engine_pool``): ``members`` (pool
        indices) or the least loaded, asleep at ``level`` until restored; a single engine has none to spare."""
        raise ValueError(f"{type(self).__name__} runs a single engine: none can be released")

    async def restore_engines(self) -> dict[str, float]:
        """Route to released engines again (a pool); nothing to do for a single engine."""
        return {}

    # ------------------------------------------------------------------ tensor weight push
    # The engine side of ``weight_sync.push.transport`` (vLLM's weight-transfer API). Every list is
    # one entry per engine *replica* (one TP group each), in the same order as weight_receivers().

    async def weight_receivers(self) -> list[tuple[str, str]]:
        """(receiver id, Ray node id) of each replica; the id changes when an engine is replaced
        (e.g. rebuilt by an elastic-TP switch), so a new push set-up is needed."""
        raise CapabilityAbsent(f"{type(self).__name__} takes no tensor weight push "
                               "(use rollout.weight_sync_format=sharded or hf)")

    async def open_weight_receiver(self, init_infos: list[dict]) -> None:
        """Join a push set-up (vLLM ``init_weight_transfer_engine``), one init info per replica."""
        raise CapabilityAbsent(f"{type(self).__name__} takes no tensor weight push")

    async def receive_weights(self, sync_id: int, version: int) -> list[dict[str, float]]:
        """Take push ``sync_id`` while the trainer ranks send it, load it in place and tag later
        completions with ``version``; returns each replica's figures (the slowest rank's seconds,
        ``load_s``, ``transport_s``, bytes). Like :meth:`reload_weights`: never with requests in
        flight. A failed push leaves the engine refusing requests (its weights are half new)."""
        raise CapabilityAbsent(f"{type(self).__name__} takes no tensor weight push")

    async def close_weight_receiver(self) -> None:
        """Leave the push set-up (vLLM ``shutdown_weight_transfer_engine``); no-op when none."""

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve (its processes died); return at once when it
        can. Cheap and bounded: a supervised pool (``engine_pool``) calls it on each member
        periodically while requests are in flight, so a dead engine is noticed even when no
        completion fails. The default (an in-process engine with nothing to lose) is always healthy."""

    async def supervise(self, restore: "WeightsRestorer") -> None:
        """Give the engine layer the loop's way to bring replacement engines to the current policy
        version: ``restore(engine)`` (a push, or a reload of the weight directory). A supervised
        pool calls it when a replacement must serve before the next push (no healthy member left).
        An engine that is not supervised has nothing to replace: the default ignores it."""

    async def recover(self, error: BaseException) -> bool:
        """After a call through this engine failed with ``error`` (e.g. a weight push, which cannot
        be retried from inside): replace the engines that are dead, bring every engine to the
        current weights (``restore``) and return True; False when none is dead (``error`` is the
        call's own). Raises when a replacement failed or the restart budget is spent. The default
        (an engine without supervision) has nothing to recover."""
        return False

    async def drain_trace(self) -> list[dict]:
        """The engine iterations recorded since the last call (``rollout.engine_trace``), handed over
        once: one dict per engine replica with ``tp``, ``max_num_seqs``, ``kv_capacity_tokens``,
        ``block_size``, ``columns`` (``megatron_rl.rollout.actor.engine_trace.COLUMNS``) and ``rows``; a pool adds each
        replica's ``engine`` index. The default (an engine that records no trace) has none."""
        return []

    @abc.abstractmethod
    async def stats(self) -> EngineStats:
        """Current load: running, waiting, preemptions, KV usage."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Free the engine; pending requests are aborted."""


MemberKind = Literal["call", "stream", "property"]
"""How a contract member is answered: 'call' a coroutine method, 'stream' a plain method returning
an async iterator (``completions``), 'property' a read-only attribute."""

SINGLE_ENGINE_DEFAULTS: frozenset[str] = frozenset({"active_engines", "release_engines", "restore_engines",
                                                    "supervise", "recover"})
"""The pool members a single engine (not a pool) keeps at the contract's default: one engine
generating, none to release, nothing to restore; supervision (replacing dead members) lives in the
pool, so a single engine ignores a restorer and has nothing to recover."""

WeightsRestorer = Callable[["RolloutEngine"], Awaitable[dict]]
"""``restore(engine)``: bring freshly started engines to the current policy version (the loop's
push or reload); returns the figures of that sync."""


def _member_kind(name: str, value: object) -> MemberKind:
    if isinstance(value, property):
        return "property"
    if inspect.iscoroutinefunction(value):
        return "call"
    if inspect.isfunction(value) and "AsyncIterator" in str(value.__annotations__.get("return", "")):
        return "stream"
    raise TypeError(f"RolloutEngine.{name}: a contract member is a coroutine method, a method returning an "
                    "AsyncIterator, or a property")


ENGINE_CONTRACT: Mapping[str, MemberKind] = MappingProxyType({
    name: _member_kind(name, value) for name, value in vars(RolloutEngine).items()
    if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))})
"""Every member of the engine interface (the public methods and properties of :class:`RolloutEngine`, in
the order they are defined there) and how it is answered. Wrappers forward exactly these
(``engine_wrapper.ForwardingEngine``, the Ray client and actor), so a new member is one edit:
define it, with its contract in the docstring, on :class:`RolloutEngine`."""


async def forward_completions(engine: RolloutEngine, deliver: Callable[[Completion], None],
                              fail: Callable[[Exception], None]) -> None:
    """Pump ``engine.completions()`` into ``deliver`` until the stream ends.

    Meant to run as a task beside the consumer. If the engine (or ``deliver``) fails, the
    exception goes to ``fail`` (e.g. onto the consumer's queue) instead of dying with the task;
    cancellation propagates.
    """
    try:
        async for completion in engine.completions():
            deliver(completion)
    except Exception as exc:
        fail(exc)


async def read_completions(queue: asyncio.Queue, *,
                           keep_failure: bool | Callable[[Exception], bool] = False) -> AsyncIterator[Completion]:
    """Yield the completions a pump puts on ``queue`` (see :func:`forward_completions`); an exception
    on it is raised instead, ending the iterator. With ``keep_failure`` it is put back first, so
    every reader (and the next one) sees the failure too. A reader cancelled or abandoned while it
    waits loses nothing: ``asyncio.Queue.get`` takes an item only when it returns it. ``keep_failure``
    may also be a predicate: only the failures it accepts are put back (a pool's final error, not a
    consumer's own)."""
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            if keep_failure is True or (callable(keep_failure) and keep_failure(item)):
                queue.put_nowait(item)
            raise item
        yield item


async def generate_all(engine: RolloutEngine, requests: list[GenerationRequest]) -> dict[str, Completion]:
    """Submit ``requests`` and wait until each has its completion; completions of other requests
    the stream yields meanwhile are passed over. For tools and checks that run one batch at a
    time: the loop streams completions as they come instead."""
    await asyncio.gather(*(engine.submit(r) for r in requests))
    want: set[str] = {r.request_id for r in requests}
    got: dict[str, Completion] = {}
    if not want:
        return got
    async for completion in engine.completions():
        if completion.request_id in want:
            got[completion.request_id] = completion
            if len(got) == len(want):
                return got
    raise RuntimeError(f"the engine's completion stream ended with {len(want) - len(got)} of {len(want)} "
                       "requests still unanswered")

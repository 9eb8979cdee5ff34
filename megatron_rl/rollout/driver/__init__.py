"""The driver's side of the rollout engines: what the loop holds and what starts and watches engines.

The Ray client of one engine actor (``ray_engine``), the pool over several engines with its handoff
and per-member supervision (``engine_pool``, ``pool_handoff``, ``pool_supervision``,
``engine_health``, ``migration``), the elastic-TP wrapper (``elastic``) and the one factory that
starts every engine of a run (``engine_factory``). The engine's own process is ``rollout.actor``;
the code vLLM loads into its workers is ``rollout.worker``.
"""

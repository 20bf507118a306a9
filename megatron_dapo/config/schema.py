"""The config tree: one typed dataclass per component, each field with its meaning in the paper; YAML files
hold deltas over these defaults (loading.py); `validate()` (validation.py) runs the checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_dapo.config.fields import (  # noqa: F401 - the tree's vocabulary, imported from here too
    DEFAULT_BUCKET_MB, POLICY_LOSSES, PROMPT_TEMPLATES, REWARD_FUNCTION, REWARDS, ConfigError, FilterMetric, LossAggMode,
    OnExhausted, knob)
from megatron_dapo.config.sglang import SGLangConfig
from megatron_dapo.config.tools import ToolsConfig


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel: int = knob(1, "[1, inf)")
    """Megatron tensor-parallel size (TP)."""
    pipeline_parallel: int = knob(1, "[1, inf)")
    """Megatron pipeline-parallel size (PP); DP = world_size / (TP * PP)."""
    expert_parallel: int = knob(1, "[1, inf)")
    """Mixture-of-experts models: experts split over this many ranks (EP), inside the TP x DP ranks of a
    pipeline stage; must divide num_experts and world_size / (TP * PP)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto = nccl with CUDA, gloo without. nccl is `cpu:gloo,cuda:nccl`: device
    tensors go over NCCL, the host-side control messages (headers, counts, flags) over gloo beside it."""
    timeout_s: float = knob(1800.0, "(0, inf)")
    """Limit on one collective among the ranks (a rank that stops answering fails the job after it). The
    other ranks wait for the driver's rollout, evaluation and server start-up host-side (on the rendezvous
    store, as long as the driver lives), not in a collective: hours-long rollouts need no longer limit."""
    driver_heartbeat_timeout_s: float = knob(1800.0, "(0, inf)")
    """The ranks waiting for the driver stop, naming its last phase, when its heartbeat (a thread) is silent this
    long: stopped or frozen, not slow; 30 min outlasts a healthy driver's pauses, far below a Slurm limit."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1; a MoE model at TP > 1 needs it)."""


@dataclass(kw_only=True)
class ModelConfig:
    hf_dir: str | None = None
    """Hugging Face checkpoint dir (config.json, weights, tokenizer) the policy starts from."""
    load: str | None = knob(None, on_resume=True)
    """Megatron distributed checkpoint to start from instead of hf_dir's weights."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype: auto = bf16 on GPU (fp32 main grads), fp32 on CPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer spec: auto = Transformer Engine when it imports, else the local spec."""
    local_attention: Literal["sdpa", "megatron"] = "sdpa"
    """The local spec's core attention: torch's SDPA (fused) or Megatron's (unfused; actor/attention.py)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation granularity."""
    chat_template: str = "auto"
    """How prompts are rendered: auto = the tokenizer's chat template (plain text if it has none); none =
    plain text (base models); or a Jinja file replacing the tokenizer's. Start-up says which is used."""
    moe_experts: Literal["auto", "grouped", "sequential"] = "auto"
    """A MoE model's routed experts: grouped = one grouped GEMM per layer for all local experts (Transformer
    Engine's GroupedLinear); sequential = megatron-core's loop of one small matmul pair per expert; auto = grouped
    wherever the Transformer Engine spec is in use, else sequential (the CPU). Start-up names the choice."""


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = knob(1e-6, "(0, 1]", "an AdamW step moves every weight by about lr; the paper uses 1e-6")
    """AdamW learning rate (paper: 1e-6), constant after warm-up; at most 1."""
    warmup_steps: int = knob(20, "[0, inf)")
    """Linear warm-up over this many optimizer updates (paper: 20)."""
    weight_decay: float = knob(0.1, "[0, inf)")
    """AdamW decoupled weight decay."""
    grad_clip: float = knob(1.0, "[0, inf)", "0 disables clipping")
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = knob(0.9, "[0, 1)")
    adam_beta2: float = knob(0.999, "[0, 1)")
    adam_eps: float = knob(1e-8, "(0, inf)")
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""


@dataclass(kw_only=True)
class ActorConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = knob(0, "[0, inf)", "0 = sized from the vocabulary")
    """Token budget of one training micro-batch (samples are packed up to it). 0 = from the vocabulary
    (config/sizing.py): the largest power of two <= 16384 whose fp32 logits shard (tokens x vocab / TP
    x 4 bytes) fits in 256 MiB on CPU, 2 GiB on GPU: 16384 for a small vocabulary, 1024 for a 49k one
    on CPU. Logits dominate a small model's memory at real vocabularies."""
    logprob_micro_batch_tokens: int = knob(0, "[0, inf)", "0 = sized from the vocabulary")
    """Token budget of one micro-batch when computing pi_old log-probs; 0 = as above with twice the
    budget, at most 32768."""
    offload_when_idle: bool = True
    """Colocated mode: move params/grads/optimizer state to CPU while the rollout holds the GPU."""
    loss_impl: Literal["auto", "logits", "linear"] = "auto"
    """How the loss reads the model: logits = the output layer's logits in the model's dtype, streamed
    through the fused kernels (no fp32 copy); linear = final hidden states + the output weight fused into
    the kernels (no logits tensor at all); auto = linear, or logits with parallel.sequence_parallel."""
    shared_prefix: Literal["auto"] | bool = "auto"
    """Compute each group's prompt once (pi_old and the updates): its G responses packed behind one copy, each
    attending to the prompt and itself at its own positions; exact (actor/prefix.py). auto = on with the local
    layer spec; Transformer Engine ignores the block mask (off; true is an error). YAML: on/off = true/false."""
    routing_replay: Literal["none", "r2", "r3"] = "none"
    """MoE: r2 = the updates take the experts pi_old's pass routed each token to; r3 = pi_old's pass and the
    updates take the experts the rollout engine routed each token to, prompt included (actor/routing.py)."""

    def resolved_loss_impl(self, sequence_parallel: bool) -> str:
        """"logits" or "linear": auto is linear unless the hidden states are sequence-sharded."""
        if self.loss_impl == "auto":
            return "logits" if sequence_parallel else "linear"
        return self.loss_impl

    def resolved_shared_prefix(self, transformer_engine: bool) -> bool:
        """Whether the actor shares each group's prompt (`transformer_engine`: the TE layer spec is in use)."""
        if self.shared_prefix == "auto" or not self.shared_prefix:
            return self.shared_prefix == "auto" and not transformer_engine
        if transformer_engine:
            raise ValueError("actor.shared_prefix=on needs the local layer spec (model.transformer_impl=local): "
                             "Transformer Engine's causal attention ignores the block mask")
        return True


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["embedded", "sglang"] = "embedded"
    """Rollout engine: embedded (in-process, CPU default) or SGLang servers."""
    colocate: bool = True
    """Hybrid engine: rollout and actor share the devices; each sleeps while the other works."""
    max_prompt_len: int = knob(2048, "[1, inf)")
    """Prompts longer than this many tokens are skipped by the data loader."""
    max_response_len: int = knob(20480, "[1, inf)")
    """Hard generation limit L_max (paper: 16384 expected + 4096 buffer = 20480)."""
    temperature: float = knob(1.0, "[0, inf)", "0 = greedy")
    """Sampling temperature for training rollouts (paper: 1.0)."""
    top_p: float = knob(1.0, "(0, 1]")
    """Nucleus sampling for training rollouts (paper: 1.0)."""
    weight_sync_bucket_mb: int = knob(0, "[0, 65536]", "0 = per transport; at most 64 GiB")
    """Size of one weight-sync bucket in MiB (actor -> rollout); 0 = per transport (DEFAULT_BUCKET_MB:
    tensor 512, distributed 256, disk 1024). A tensor larger than a bucket travels alone. The planner adds
    the bucket (or the largest tensor) to the sync phase and refuses it if the GPU cannot hold it."""
    weight_sync_probe: bool = True
    """After every weight sync the engine and the actor score one fixed 16-token sequence; a mean logprob
    difference above the dtype's tolerance (fp32 0.01, bf16 0.5) stops the run naming the step
    (rollout/weight_sync_probe_absdiff). One short forward on each side."""

    def bucket_mb(self) -> int:
        """The bucket size this config's weight transport uses, in MiB."""
        return self.weight_sync_bucket_mb or DEFAULT_BUCKET_MB[self.sglang.weight_sync]
    streaming: bool = True
    """Streaming rollout (collect/streaming.py): groups are scored as each finishes, the stream is kept topped
    up (algo.gen_batch_multiplier x missing / kept fraction in flight), and the step stops at N informative
    groups, aborting the rest. It keeps the groups that finish first, so its responses run shorter than
    the rounds' when lengths have a long tail (partial_rollout continues the aborted ones instead).
    false = the paper's Algorithm 1 exactly: synchronous rounds (collect/rounds.py)."""
    max_inflight_groups: int = knob(0, "[0, inf)", "0 = automatic")
    """Streaming: at most this many groups submitted and unfinished (0 = 2 x ceil(N x gen_batch_multiplier))."""
    partial_rollout: bool = False
    """Streaming: the groups a step aborts continue in the next step from where they
    stopped (slime's partial rollout) instead of being dropped; their earlier tokens were sampled by an
    older policy (rollout correction weighs them). The carried groups are saved in checkpoints."""
    max_carry_steps: int = knob(4, "[0, inf)", "0 = no bound")
    """Partial rollout: a group is carried into at most this many later steps, so its oldest tokens are at
    most this many policy updates stale; one still unfinished after that is dropped when the step aborts
    it (rollout/dropped_stale_groups; its tokens count as wasted). 0 = no bound."""
    async_steps: int = knob(0, "[0, 8]", "0 = synchronous")
    """Off-policy pipelining (schedule/pipeline.py; the engine on its own devices, colocate=false): the engine
    runs up to k batches ahead, batch b from the weights after step b-1-k, so a trained group is k versions old
    (rollout/staleness_*; older ones, partial rollout's carried groups, are dropped and counted). π_old is the
    actor's recompute; algo.rollout_correction=auto weighs the gap with token_tis. 0 = Algorithm 1."""
    async_mode: Literal["batch", "stream"] = "batch"
    """batch: new weights reach the engine between batches; stream: fully async, mid-batch (pipeline.py)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)  # multi-turn tool rollouts (config/tools.py)

    @property
    def lagged(self) -> bool:
        """A step's weights reach the engine later, as a host snapshot the producer hands over (async_steps >= 2,
        or any async_steps with async_mode=stream), not synced at the step's end (schedule/schedule.py)."""
        return self.async_steps >= 2 or (self.async_steps > 0 and self.async_mode == "stream")


@dataclass(kw_only=True)
class RewardConfig:
    name: str = "math_dapo"
    """math_dapo = the rule-based verifier: +1 if the extracted answer equals the truth else -1 (eq. 7);
    math_verify = the same answer line, also judged equal when Hugging Face's math-verify finds it
    mathematically equivalent (fractions, radicals, intervals, ...; needs `pip install megatron-dapo[math]`);
    or `module.path:function`, a callable (response, ground_truth, sample) -> reward.RewardResult,
    imported once. A math_verify or user call that raises, times out or returns something else scores -1
    and is counted (reward/failures), the first one logged with its traceback."""
    timeout_s: float = knob(10.0, "[0, inf)", "0 = no limit")
    """Limit on one call of math_verify or a user reward function (0 = none; math_dapo is bounded)."""
    soft_overlong_punishment: bool = True
    """Add eq. 13's length-aware penalty inside the last cache_len tokens before L_max."""
    overlong_cache_len: int = knob(4096, "[0, inf)")
    """L_cache of eq. 13: the punishment interval before rollout.max_response_len (paper: 4096)."""
    overlong_penalty_factor: float = knob(1.0, "[0, inf)")
    """Scale of the soft overlong penalty (eq. 13 reaches -factor at L_max)."""
    answer_fallback: Literal["none", "boxed"] = "none"
    """Where the answer is read: none = only the last "Answer:" line (the DAPO rule; the DAPO-Math-17K
    prompts, the built-in arithmetic task and our GSM8K template all ask for it); boxed = when that line
    is missing, also the last \\boxed{} and then a "####" line, for prompts that ask for those (MATH-style
    "put your answer in \\boxed{}", raw GSM8K few-shot prompts)."""


@dataclass(kw_only=True)
class AlgoConfig:
    group_size: int = knob(16, "[2, inf)", "group advantages need G >= 2")
    """G: responses sampled per prompt (paper: 16)."""
    policy_loss: str = "dapo"
    """The loss (algo/policy_losses.py): dapo = eq. 10's token-level clip-higher loss; gspo = GSPO's clipped
    sequence ratio (Zheng et al. 2025); cispo = MiniMax-M1's capped, detached IS weight x A x log pi; dr_grpo =
    Dr. GRPO (Liu et al. 2025: advantages not divided by the group std, token sums / (sequences x
    rollout.max_response_len)); or `module.path:function`, a function decorated with register_policy_loss."""
    eps_low: float | None = knob(None, "[0, 1)", "or null for the policy loss's default")
    """Lower clip range: ratio is clipped at 1 - eps_low for negative advantages. None = the loss's default:
    0.2 (dapo, the paper's; dr_grpo), 3e-4 (gspo); cispo has no lower bound and takes none."""
    eps_high: float | None = knob(None, "[0, inf)", "or null for the policy loss's default")
    """Upper clip range, decoupled (Clip-Higher). None = the loss's default: 0.28 (dapo, the paper's),
    0.2 (dr_grpo; eps_high = eps_low is vanilla PPO), 4e-4 (gspo); for cispo the cap of its weight
    min(r, eps_high), 5 by default (ScaleRL's)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """token-mean = DAPO token-level loss; seq-mean-token-mean = GRPO; seq-mean-token-sum (dr_grpo: token-mean)."""
    entropy_coef: float = knob(0.0, "(-inf, inf)")
    """Entropy bonus in the loss; 0 = entropy is monitored only."""
    overlong_filtering: bool = False
    """Mask truncated responses (finish reason "length") out of the loss."""
    void_turn_filter: bool = False
    """SimpleTIR (rollout.tools): a sample whose last turn has no complete code block nor answer: no loss."""
    dynamic_sampling: bool = True
    """Drop uninformative groups (see filter_metric); generate more until the batch is full."""
    filter_metric: FilterMetric = "acc"
    """What makes a group informative for dynamic sampling: acc = 0 < #correct < G (paper eq. 11);
    score = its rewards differ, which also keeps all-wrong groups that differ only by the soft
    overlong penalty. The kept fraction and the adaptive round size follow it."""
    max_gen_rounds: int = knob(10, "[1, inf)")
    """Cap on generation rounds per step when dynamic sampling keeps too few groups."""
    on_rounds_exhausted: OnExhausted = "train_partial"
    """When the cap is hit: train on the informative groups found (with a warning) or stop."""
    gen_batch_multiplier: float = knob(1.0, "[1, inf)")
    """Prompts per generation round = multiplier * train.prompt_batch_size (verl: 3.0)."""
    epochs_per_rollout: int = knob(1, "[1, inf)")
    """Passes over each rollout batch; updates per step = epochs * batch / mini_batch."""
    clip_ratio_c: float | None = knob(None, "(1, inf)", "or null for no dual-clip")
    """Dual-clip bound c > 1: for negative advantages the token loss is capped at -c * A (verl's
    clip_ratio_c; its DAPO recipe uses 10). None = off, the paper's eq. 10."""
    old_logprob_source: Literal["recompute", "rollout", "auto"] = "recompute"
    """pi_old of the ratio: recompute = a forward pass of the trainer before the updates; rollout = the
    engine's sampling logprobs (skips that pass; the train-inference mismatch then enters the ratio);
    auto = rollout where the engine computes the actor's own function (the embedded engine on the actor's
    float32 parameters, no rollout correction, no partial rollout: equal to a recompute up to float
    rounding), else recompute; start-up says which and why (loop/old_policy.py)."""
    rollout_correction: Literal["auto", "none", "token_tis", "seq_tis", "token_mis", "seq_mis"] = "auto"
    """Importance weights for the train-inference mismatch, w from pi_old / pi_rollout
    (algo/rollout_correction.py): token_tis / seq_tis truncate the token / sequence ratio at the
    threshold; token_mis / seq_mis drop tokens / whole sequences whose ratio leaves [threshold_low,
    threshold]. none = no weights. auto = token_tis when rollout.async_steps > 0 (an older policy's batch)."""
    rollout_correction_threshold: float = knob(2.0, "(0, inf)")
    """C: the truncation bound (tis) or the upper end of the kept band (mis); > 0."""
    rollout_correction_threshold_low: float | None = knob(None, "(0, inf)")
    """Lower end of the mis band; None = 1 / rollout_correction_threshold. Ignored by tis."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str = "builtin:arithmetic?n=2000&seed=0"
    """Training prompts: DAPO-Math-17K parquet/jsonl, GSM8K jsonl, or builtin:arithmetic?..."""
    val_path: str | None = None
    """Validation prompts (same formats); None disables evaluation."""
    max_prompt_chars: int | None = knob(None, "[1, inf)")
    """Rows whose prompt text is longer than this are skipped (counted, reported)."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded)."""
    prompt_template: str = "auto"
    """How a row becomes the user message (data/templates.py): auto = each dataset's own form
    (DAPO-Math-17K rows as stored, with the DAPO instruction; GSM8K with that instruction; arithmetic
    bare); dapo_math = the DAPO-Math-17K instruction around the question; dapo_math_tool = the same, saying the
    model may run Python (rollout.tools with its default fences); gsm8k = the question + "output
    the final answer after ####" (needs reward.answer_fallback=boxed); raw = the question alone; or a
    file: Jinja (*.jinja, *.j2) or a Python format string, with {question} and {data_source}."""
    system_prompt: str | None = None
    """A system message for every prompt (replacing a row's own). None = none added; a chat template
    may still insert its default one (Qwen2.5 does): start-up reports it."""
    few_shot_path: str | None = None
    """jsonl of {"question", "response"} examples, put before every prompt as user/assistant turns."""


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = knob(5, "[0, inf)", "0 = never")
    """Evaluate every this many steps (0 = never)."""
    n_samples: int = knob(32, "[1, inf)")
    """k of avg@k: samples per validation prompt (paper: 32)."""
    temperature: float = knob(1.0, "[0, inf)")
    """Evaluation sampling temperature (paper: 1.0)."""
    top_p: float = knob(0.7, "(0, 1]")
    """Evaluation top-p (paper: 0.7)."""
    max_prompts: int | None = knob(None, "[1, inf)")
    """Evaluate on at most this many validation prompts."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = knob(100, "[1, inf)", on_resume=True)
    """Rollout steps to run."""
    prompt_batch_size: int = knob(512, "[1, inf)")
    """Prompts per rollout step after dynamic sampling (paper: 512)."""
    mini_batch_size: int = knob(32, "[1, inf)")
    """Prompts per optimizer update with their G responses (paper: 32 prompts x 16 = 512, 16 updates a step)."""
    seed: int = knob(1, "[0, inf)")
    """Seeds data order, sampling and initialisation."""
    deterministic: bool = False
    """Deterministic kernels in torch, Megatron + TE, NCCL, SGLang: a slower backward and rollouts (loop/determinism.py)."""
    rollout_budget: int = knob(0, "[0, inf)", "0 = no limit")
    """Stop once this many responses have been generated (0 = no limit): equal-budget ablations. It counts
    finished responses: with streaming, the aborted ones are not counted (rollout/wasted_tokens shows
    their cost), so compare budgets between runs of one rollout mode."""


@dataclass(kw_only=True)
class CheckpointConfig:
    ON_RESUME: ClassVar[bool] = True
    """A resumed run may change any of these."""

    dir: str = "checkpoints"
    """Root folder; a run writes into <dir>/<logging.run_name>/."""
    save_every: int = knob(50, "[0, inf)", "0 = only at the end")
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep_last: int = knob(3, "[1, inf)")
    """Keep this many most recent checkpoints."""
    resume: str = "auto"
    """auto = continue from the newest checkpoint of this run that verifies; none; or a checkpoint path."""
    overwrite: bool = False
    """Delete what the run folder holds of another run (or checkpoints newer than the one resumed) instead
    of refusing to start: a run owns <dir>/<logging.run_name>/."""
    export_hf: bool = True
    """Export the final policy in Hugging Face format."""


@dataclass(kw_only=True)
class WandbConfig:
    ON_RESUME: ClassVar[bool] = True
    """A resumed run may change any of these."""

    enabled: bool = False
    """Mirror the TensorBoard scalars, the sampled responses (as tables) and the run's config to Weights &
    Biases (needs `pip install "megatron-dapo[wandb]"`). TensorBoard stays on and is the source of truth."""
    project: str = "megatron-dapo"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None = the account's default."""
    mode: Literal["online", "offline"] = "online"
    """online = stream to the W&B server (needs a login: WANDB_API_KEY); offline = write the run under
    <tensorboard_dir>/<run_name>/wandb/ only, for `wandb sync` later (no network needed)."""


@dataclass(kw_only=True)
class LoggingConfig:
    run_name: str = knob("dapo", on_resume=True)
    """Names the run's checkpoint and TensorBoard folders."""
    tensorboard_dir: str = knob("runs", on_resume=True)
    """TensorBoard event files go to <tensorboard_dir>/<run_name>/."""
    entropy_collapse_frac: float = knob(0.1, "[0, 1]")
    """Alarm when actor entropy falls below this fraction of its first value."""
    length_blowup_frac: float = knob(0.95, "(0, 1]")
    """Alarm when the mean response length exceeds this fraction of max_response_len."""
    samples_every: int = knob(10, "[0, inf)", "0 = never (evaluations still write theirs)")
    """Write sampled training responses to <tensorboard_dir>/<run_name>/samples/step_<k>.jsonl every this
    many steps (0 = never); every evaluation writes its own there too."""
    samples_per_step: int = knob(32, "[0, inf)")
    """Responses per split (train / val) in each samples file; the first 4 also go to TensorBoard text."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def rollout_correction(self) -> str:
        """algo.rollout_correction with auto resolved: token_tis for an off-policy pipeline, else none."""
        name = self.algo.rollout_correction
        return name if name != "auto" else "token_tis" if self.rollout.async_steps > 0 else "none"

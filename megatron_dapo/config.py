"""One typed config tree for a DAPO run.

YAML files hold deltas over the defaults below; dotted CLI overrides (`algo.eps_high=0.28`) are
applied last. Unknown keys and wrong types are errors that name the key. `validate()` runs the
cross-field checks before anything heavy is imported.

    python -m megatron_dapo.config --config examples/configs/tiny_cpu.yaml algo.eps_high=0.3 --print
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the key."""


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """Megatron tensor-parallel size (TP)."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size (PP); DP = world_size / (TP * PP)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; auto = nccl with CUDA, gloo without."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1 and the Transformer Engine spec)."""


@dataclass(kw_only=True)
class ModelConfig:
    hf_dir: str | None = None
    """Hugging Face checkpoint dir (config.json, weights, tokenizer) the policy starts from."""
    load: str | None = None
    """Megatron distributed checkpoint to start from instead of hf_dir's weights."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype: auto = bf16 on GPU (fp32 main grads), fp32 on CPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer spec: auto = Transformer Engine when it imports, else the local spec."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation granularity."""


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 1e-6
    """AdamW learning rate (paper: 1e-6), constant after warm-up."""
    warmup_steps: int = 20
    """Linear warm-up over this many optimizer updates (paper: 20)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""


@dataclass(kw_only=True)
class ActorConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = 16384
    """Token budget of one training micro-batch (samples are packed up to it)."""
    logprob_micro_batch_tokens: int = 32768
    """Token budget of one micro-batch when computing pi_old log-probs."""
    offload_when_idle: bool = True
    """Colocated mode: move params/grads/optimizer state to CPU while the rollout holds the GPU."""


@dataclass(kw_only=True)
class SGLangConfig:
    mem_fraction_static: float = 0.6
    """Fraction of GPU memory SGLang takes for weights + KV cache when colocated."""
    tensor_parallel: int = 1
    """TP size of each SGLang server (one server per rollout TP group)."""
    num_servers: int = 0
    """SGLang servers per node, one per rollout TP group (0 = fill the node: visible GPUs // TP, one on
    CPU). Server k uses GPUs k*TP .. k*TP+TP-1; prompts are split evenly over all servers of the job,
    weight updates go to every one."""
    base_port: int = 30000
    """First port; server k listens on base_port + k, bound to 127.0.0.1."""
    startup_timeout_s: float = 600.0
    """Fail (naming the server log) if /health does not answer within this time."""
    request_timeout_s: float = 3600.0
    """Fail a /generate call that takes longer than this."""
    weight_sync: Literal["tensor", "distributed", "disk"] = "tensor"
    """tensor = colocated in-memory buckets; distributed = NCCL broadcast; disk = via files."""
    extra_args: str = ""
    """Extra `sglang.launch_server` flags, passed through verbatim."""


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["embedded", "sglang"] = "embedded"
    """Rollout engine: embedded (in-process, CPU default) or SGLang servers."""
    colocate: bool = True
    """Hybrid engine: rollout and actor share the devices; each sleeps while the other works."""
    max_prompt_len: int = 2048
    """Prompts longer than this many tokens are skipped by the data loader."""
    max_response_len: int = 20480
    """Hard generation limit L_max (paper: 16384 expected + 4096 buffer = 20480)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (paper: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts (paper: 1.0)."""
    weight_sync_bucket_mb: int = 512
    """Size of one weight-sync bucket in MiB (actor -> rollout)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass(kw_only=True)
class RewardConfig:
    name: Literal["math_dapo"] = "math_dapo"
    """Rule-based verifier: +1 if the extracted integer answer equals the truth else -1 (eq. 7)."""
    soft_overlong_punishment: bool = True
    """Add eq. 13's length-aware penalty inside the last cache_len tokens before L_max."""
    overlong_cache_len: int = 4096
    """L_cache of eq. 13: the punishment interval before rollout.max_response_len (paper: 4096)."""
    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong penalty (eq. 13 reaches -factor at L_max)."""
    answer_fallback: Literal["none", "boxed"] = "none"
    """Where the answer is read: none = only the last "Answer:" line (the DAPO rule; the DAPO-Math-17K
    prompts, the built-in arithmetic task and our GSM8K template all ask for it); boxed = when that line
    is missing, also the last \\boxed{} and then a "####" line, for prompts that ask for those (MATH-style
    "put your answer in \\boxed{}", raw GSM8K few-shot prompts)."""


@dataclass(kw_only=True)
class AlgoConfig:
    group_size: int = 16
    """G: responses sampled per prompt (paper: 16)."""
    eps_low: float = 0.2
    """Lower clip range: ratio is clipped at 1 - eps_low for negative advantages (paper: 0.2)."""
    eps_high: float = 0.28
    """Upper clip range, decoupled (Clip-Higher, paper: 0.28); eps_high = eps_low is vanilla PPO."""
    loss_agg_mode: LossAggMode = "token-mean"
    """token-mean = DAPO token-level loss; seq-mean-token-mean = GRPO; seq-mean-token-sum."""
    kl_coef: float = 0.0
    """KL penalty to a reference policy; DAPO removes it (0). Only 0 is supported."""
    entropy_coef: float = 0.0
    """Entropy bonus in the loss; 0 = entropy is monitored only."""
    overlong_filtering: bool = False
    """Mask truncated responses (finish reason "length") out of the loss."""
    dynamic_sampling: bool = True
    """Drop uninformative groups (see filter_metric); generate more until the batch is full."""
    filter_metric: Literal["acc", "score"] = "acc"
    """What makes a group informative for dynamic sampling: acc = 0 < #correct < G (paper eq. 11);
    score = its rewards differ, which also keeps all-wrong groups that differ only by the soft
    overlong penalty. The kept fraction and the adaptive round size follow it."""
    max_gen_rounds: int = 10
    """Cap on generation rounds per step when dynamic sampling keeps too few groups."""
    on_rounds_exhausted: Literal["train_partial", "error"] = "train_partial"
    """When the cap is hit: train on the informative groups found (with a warning) or stop."""
    gen_batch_multiplier: float = 1.0
    """Prompts per generation round = multiplier * train.prompt_batch_size (verl: 3.0)."""
    epochs_per_rollout: int = 1
    """Passes over each rollout batch; updates per step = epochs * batch / mini_batch."""
    clip_ratio_c: float | None = None
    """Dual-clip bound c > 1: for negative advantages the token loss is capped at -c * A (verl's
    clip_ratio_c; its DAPO recipe uses 10). None = off, the paper's eq. 10."""
    old_logprob_source: Literal["recompute", "rollout"] = "recompute"
    """pi_old of the ratio: recompute = a forward pass of the trainer before the updates; rollout = the
    engine's sampling logprobs (skips that pass; the train-inference mismatch then enters the ratio)."""
    rollout_correction: Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis"] = "none"
    """Importance weights for the train-inference mismatch, w from pi_old / pi_rollout
    (algo/rollout_correction.py): token_tis / seq_tis truncate the token / sequence ratio at the
    threshold; token_mis / seq_mis drop tokens / whole sequences whose ratio leaves
    [threshold_low, threshold]. none = no weights."""
    rollout_correction_threshold: float = 2.0
    """C: the truncation bound (tis) or the upper end of the kept band (mis); > 0."""
    rollout_correction_threshold_low: float | None = None
    """Lower end of the mis band; None = 1 / rollout_correction_threshold. Ignored by tis."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str = "builtin:arithmetic?n=2000&seed=0"
    """Training prompts: DAPO-Math-17K parquet/jsonl, GSM8K jsonl, or builtin:arithmetic?..."""
    val_path: str | None = None
    """Validation prompts (same formats); None disables evaluation."""
    max_prompt_chars: int | None = None
    """Rows whose prompt text is longer than this are skipped (counted, reported)."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded)."""


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = 5
    """Evaluate every this many steps (0 = never)."""
    n_samples: int = 32
    """k of avg@k: samples per validation prompt (paper: 32)."""
    temperature: float = 1.0
    """Evaluation sampling temperature (paper: 1.0)."""
    top_p: float = 0.7
    """Evaluation top-p (paper: 0.7)."""
    max_prompts: int | None = None
    """Evaluate on at most this many validation prompts."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 100
    """Rollout steps to run."""
    prompt_batch_size: int = 512
    """Prompts per rollout step after dynamic sampling (paper: 512)."""
    mini_batch_size: int = 32
    """Prompts per optimizer update, all their G responses included (paper: 512 responses = 32 prompts x 16,
    so 16 updates per step)."""
    seed: int = 1
    """Seeds data order, sampling and initialisation."""
    deterministic: bool = False
    """Deterministic algorithms (slower); required for exact resume comparisons."""
    rollout_budget: int = 0
    """Stop once this many responses have been generated (0 = no limit): equal-budget ablations."""


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "checkpoints"
    """Root folder; a run writes into <dir>/<logging.run_name>/."""
    save_every: int = 50
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep_last: int = 3
    """Keep this many most recent checkpoints."""
    resume: str = "auto"
    """auto = continue from the latest complete checkpoint if any; none; or a checkpoint path."""
    export_hf: bool = True
    """Export the final policy in Hugging Face format."""


@dataclass(kw_only=True)
class LoggingConfig:
    run_name: str = "dapo"
    """Names the run's checkpoint and TensorBoard folders."""
    tensorboard_dir: str = "runs"
    """TensorBoard event files go to <tensorboard_dir>/<run_name>/."""
    entropy_collapse_frac: float = 0.1
    """Alarm when actor entropy falls below this fraction of its first value."""
    length_blowup_frac: float = 0.95
    """Alarm when the mean response length exceeds this fraction of max_response_len."""


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


# --------------------------------------------------------------------------------------------
# Applying deltas


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    if isinstance(value, CliText):
        return _coerce_text(value, tp, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _looks_like_float(value):
        return float(value)  # YAML 1.1 reads 1e-6 as a string; users mean a number
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


class CliText(str):
    """An override value as typed on the command line; parsed as YAML against the field's type."""


def _coerce_text(text: CliText, tp: Any, key: str) -> Any:
    parsed = yaml.safe_load(text) if text.strip() else ""
    try:
        return _coerce(parsed, tp, key)
    except ConfigError:
        if _accepts_str(tp):
            return _coerce(str(text), tp, key)
        raise


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _unknown(key: str, name: str, known: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, known, n=1)
    near = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"unknown config key {key!r}{near}; valid here: {sorted(known)}")


def apply_delta(cfg: Any, delta: dict[str, Any], prefix: str = "") -> None:
    """Apply a nested mapping of overrides onto the dataclass `cfg` in place."""
    hints = _field_types(cfg)
    for name, value in delta.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise _unknown(key, str(name), list(hints))
        current = getattr(cfg, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of sub-keys, got {value!r}")
            apply_delta(current, value, prefix=f"{key}.")
        else:
            setattr(cfg, name, _coerce(value, hints[name], key))


def parse_override(text: str) -> dict[str, Any]:
    """`a.b.c=VALUE` -> {"a": {"b": {"c": CliText(VALUE)}}}, parsed as YAML against the field type."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    value = CliText(raw)
    out: dict[str, Any] = {}
    node = out
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return raw.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML delta file <- dotted overrides, then validate() (world size unknown yet)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        delta = yaml.safe_load(p.read_text()) or {}
        if not isinstance(delta, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        apply_delta(cfg, delta)
    for text in overrides:
        apply_delta(cfg, parse_override(text))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100)


# --------------------------------------------------------------------------------------------
# Cross-field validation


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks; raises ConfigError listing every problem found."""
    problems = _problems(cfg)
    if world_size is not None:
        problems += _layout_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)


def _problems(cfg: Config) -> list[str]:
    p: list[str] = []
    a, t, r, o = cfg.algo, cfg.train, cfg.rollout, cfg.actor.optimizer
    _positive(p, {"parallel.tensor_parallel": cfg.parallel.tensor_parallel,
                  "parallel.pipeline_parallel": cfg.parallel.pipeline_parallel,
                  "train.prompt_batch_size": t.prompt_batch_size, "train.mini_batch_size": t.mini_batch_size,
                  "rollout.max_response_len": r.max_response_len, "rollout.max_prompt_len": r.max_prompt_len,
                  "algo.max_gen_rounds": a.max_gen_rounds, "algo.epochs_per_rollout": a.epochs_per_rollout,
                  "actor.micro_batch_tokens": cfg.actor.micro_batch_tokens,
                  "actor.logprob_micro_batch_tokens": cfg.actor.logprob_micro_batch_tokens,
                  "rollout.weight_sync_bucket_mb": r.weight_sync_bucket_mb,
                  "eval.n_samples": cfg.eval.n_samples, "optimizer.lr": o.lr})
    if a.group_size < 2:
        p.append(f"algo.group_size={a.group_size}: group advantages need G >= 2")
    if t.prompt_batch_size % max(t.mini_batch_size, 1):
        p.append(f"train.mini_batch_size={t.mini_batch_size} must divide "
                 f"train.prompt_batch_size={t.prompt_batch_size}")
    if not 0.0 <= a.eps_low < 1.0:
        p.append(f"algo.eps_low={a.eps_low} must be in [0, 1)")
    if a.eps_high < 0.0:
        p.append(f"algo.eps_high={a.eps_high} must be >= 0")
    if a.kl_coef != 0.0:
        p.append(f"algo.kl_coef={a.kl_coef}: DAPO removes the KL term; only 0 is supported")
    p += _correction_problems(a)
    if a.gen_batch_multiplier < 1.0:
        p.append(f"algo.gen_batch_multiplier={a.gen_batch_multiplier} must be >= 1")
    if cfg.reward.soft_overlong_punishment and not 0 < cfg.reward.overlong_cache_len < r.max_response_len:
        p.append(f"reward.overlong_cache_len={cfg.reward.overlong_cache_len} must be in "
                 f"(0, rollout.max_response_len={r.max_response_len})")
    for key, top_p in (("rollout.top_p", r.top_p), ("eval.top_p", cfg.eval.top_p)):
        if not 0.0 < top_p <= 1.0:
            p.append(f"{key}={top_p} must be in (0, 1]")
    for key, temp in (("rollout.temperature", r.temperature), ("eval.temperature", cfg.eval.temperature)):
        if temp < 0.0:
            p.append(f"{key}={temp} must be >= 0")
    if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        p.append("actor.optimizer: warmup_steps, grad_clip and weight_decay must be >= 0")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_parallel == 1:
        p.append("parallel.sequence_parallel needs parallel.tensor_parallel > 1")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        p.append(f"checkpoint.resume={resume!r} must be auto, none or an existing checkpoint folder")
    if r.sglang.num_servers < 0:
        p.append(f"rollout.sglang.num_servers={r.sglang.num_servers} must be >= 0 (0 = fill the node)")
    if not 0.0 < r.sglang.mem_fraction_static < 1.0:
        p.append(f"rollout.sglang.mem_fraction_static={r.sglang.mem_fraction_static} must be in (0, 1)")
    if cfg.checkpoint.keep_last < 1:
        p.append(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    return p


def _correction_problems(a: AlgoConfig) -> list[str]:
    """Dual-clip and rollout-correction ranges."""
    p: list[str] = []
    if a.clip_ratio_c is not None and not a.clip_ratio_c > 1.0:
        p.append(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (or null for no dual-clip)")
    high, low = a.rollout_correction_threshold, a.rollout_correction_threshold_low
    if not high > 0:
        p.append(f"algo.rollout_correction_threshold={high} must be > 0")
    elif low is not None and not 0 < low < high:
        p.append(f"algo.rollout_correction_threshold_low={low} must be in "
                 f"(0, algo.rollout_correction_threshold={high})")
    elif low is None and a.rollout_correction.endswith("_mis") and not high > 1:
        p.append(f"algo.rollout_correction_threshold={high} must be > 1 for {a.rollout_correction} "
                 "(the default band's lower end is 1 / threshold)")
    if a.rollout_correction != "none" and a.old_logprob_source == "rollout":
        p.append(f"algo.rollout_correction={a.rollout_correction} with algo.old_logprob_source=rollout: "
                 "pi_old is the rollout policy then, so every correction weight would be 1")
    return p


def _positive(p: list[str], values: dict[str, float]) -> None:
    p.extend(f"{k}={v} must be > 0" for k, v in values.items() if not v > 0)


def _layout_problems(cfg: Config, world_size: int) -> list[str]:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size % (tp * pp):
        return [f"TP({tp}) x PP({pp}) = {tp * pp} does not divide world size {world_size}"]
    dp = data_parallel_size(cfg, world_size)
    if cfg.train.mini_batch_size % dp:
        return [f"train.mini_batch_size={cfg.train.mini_batch_size} must divide by DP={dp} "
                f"(world {world_size} / TP {tp} / PP {pp})"]
    return []


# --------------------------------------------------------------------------------------------
# CLI


def build_parser(description: str = "Resolve and check a megatron-dapo config.") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML file with deltas over the defaults")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.28")
    parser.add_argument("--world-size", type=int, default=None, help="also check the parallel layout")
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print:
        print(to_yaml(cfg), end="")
    else:
        print(f"config OK: {args.config or '(defaults)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

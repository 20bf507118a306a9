"""What a run says before its first step: which model, how it is laid out, where its weights came from,
how prompts are rendered and scored, and what data it read. One block in the log, on the driver rank."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_dapo import parallel
from megatron_dapo.algo.loss_settings import LossSettings
from megatron_dapo.config import Config
from megatron_dapo.config.model_checks import read_model_config
from megatron_dapo.hf_files import HFCheckpointError, hf_tensor_table
from megatron_dapo.kernels import resolve_impl
from megatron_dapo.kernels.policy_loss import loss_path
from megatron_dapo.loop import determinism


def hf_parameter_count(hf_dir: str) -> int | None:
    """Parameters stored in hf_dir's safetensors (headers only; a tied lm_head counted once)."""
    try:
        return sum(math.prod(info.shape) for info in hf_tensor_table(hf_dir).values())
    except HFCheckpointError:
        return None


def _count(n: int | None) -> str:
    if n is None:
        return "? parameters"
    return f"{n / 1e9:.2f}B parameters" if n >= 1e9 else f"{n / 1e6:.2f}M parameters"


@dataclass
class StartupReport:
    """Collected while the run is built; `lines()` is the start-up summary."""

    cfg: Config
    chat_template: str = ""
    system_prompt: str = ""
    engine: str = ""
    data: list[str] = field(default_factory=list)
    resumed_from: str | None = None
    actor_bytes_at_engine_start: int = 0
    micro_batch_tokens: tuple[int, int] = (0, 0)
    """The actor's token budgets (train, pi_old), resolved from the vocabulary when configured as 0."""
    shared_prefix: bool = False
    """actor.shared_prefix resolved: each group's prompt computed once."""
    attention: str = ""
    """The actor's core attention (actor/model.py attention_kernel)."""
    experts: str = ""
    """A MoE actor's routed-expert kernel (actor/model.py expert_kernel); "" for a dense model."""
    old_logprobs: str = ""
    """Where pi_old comes from and why (OldLogprobSource.line)."""

    def lines(self) -> list[str]:
        cfg, model = self.cfg, read_model_config(self.cfg.model.hf_dir) or {}
        arch = (model.get("architectures") or ["?"])[0]
        tp, pp = parallel.tp_size(), parallel.pp_size()
        weights = f"model.load={cfg.model.load} (architecture and tokenizer from model.hf_dir={cfg.model.hf_dir})" \
            if cfg.model.load else f"model.hf_dir={cfg.model.hf_dir}"
        if self.resumed_from:
            weights += f"; resumed from {self.resumed_from}"
        reward = cfg.reward.name + (f" (answer_fallback={cfg.reward.answer_fallback})"
                                    if cfg.reward.name == "math_dapo" else f" (timeout {cfg.reward.timeout_s:g} s)")
        return [
            f"model: {model.get('model_type', '?')} ({arch}), {_count(hf_parameter_count(cfg.model.hf_dir))}, "
            f"vocab {model.get('vocab_size', '?')}",
            f"layout: TP={tp} x PP={pp} x DP={parallel.dp_size()} (world {parallel.world_size()}); micro-batches "
            f"{self.micro_batch_tokens[0]} / {self.micro_batch_tokens[1]} tokens (train / pi_old); "
            + ("a group's prompt computed once, its responses packed behind it" if self.shared_prefix
               else "one row per sample") + f" (actor.shared_prefix={cfg.actor.shared_prefix}); attention "
            f"{self.attention}" + (f"; experts {self.experts}" if self.experts else ""),
            f"weights: {weights}",
            f"rollout engine: {self.engine}; started with the actor "
            + ("asleep" if not self.actor_bytes_at_engine_start
               else f"holding {self.actor_bytes_at_engine_start / 2**20:.1f} MiB of this rank's device"),
            f"chat template: {self.chat_template}",
            f"system prompt: {self.system_prompt}",
            f"prompt template: {cfg.data.prompt_template}" + (f", few-shot examples from {cfg.data.few_shot_path}"
                                                               if cfg.data.few_shot_path else ""),
            f"reward: {reward}",
            f"policy loss: {policy_loss_line(cfg)}",
            f"pi_old: {self.old_logprobs}",
            f"rollout schedule: {schedule_line(cfg)}",
            f"determinism: {determinism.line(cfg.train.deterministic, cfg.rollout.engine)}",
            *self.data,
        ]


def schedule_line(cfg: Config) -> str:
    """Synchronous (Algorithm 1) or pipelined, and the rollout correction that follows from it."""
    name = cfg.rollout_correction()
    correction = f"rollout correction {name}" + (" (algo.rollout_correction=auto)"
                                                 if cfg.algo.rollout_correction == "auto" else "")
    if not cfg.rollout.async_steps:
        return f"synchronous (each step generates its own batch from the newest weights); {correction}"
    k = cfg.rollout.async_steps
    if cfg.rollout.async_mode == "stream":
        return (f"fully async, rollout.async_steps={k} async_mode=stream: the next step's batch generates while the "
                f"actor trains, each step's weights reach the engine mid-batch (in-flight groups resumed on them), "
                f"a token at most {k} update(s) older than the actor; {correction}")
    return (f"off-policy pipelining, rollout.async_steps={k}: the next step's batch "
            f"generates while the actor trains, from weights {k} update(s) older; {correction}")


def policy_loss_line(cfg: Config) -> str:
    """The loss, its clip range and normaliser, and where it runs (the fused clip kernel or torch)."""
    a = cfg.algo
    settings = LossSettings.from_config(a, cfg.rollout.max_response_len)
    spec, low, high = settings.spec, settings.eps_low, settings.eps_high
    norm = "token sums / (sequences x rollout.max_response_len)" if spec.normaliser == "max_len" \
        else a.loss_agg_mode
    advantages = "" if spec.scale_advantages_by_std else ", advantages not divided by the group std"
    clip = f"eps_low {low:g}, " if spec.eps_low is not None or a.eps_low is not None else "no lower bound, "
    return (f"{a.policy_loss} ({clip}eps_high {high:g}, {norm}{advantages}); "
            f"{loss_path(a.policy_loss, resolve_impl('auto', parallel.device()))}")


def system_prompt_note(configured: str | None, template_default: str | None) -> tuple[str, bool]:
    """(what the system prompt is, whether to warn): a template's silent default is worth a warning."""
    if configured is not None:
        return f"{configured!r} (data.system_prompt)", False
    if template_default:
        return (f"{template_default!r}, inserted by the chat template into every prompt without a system "
                "message (set data.system_prompt to replace it)"), True
    if template_default == "":
        return "an empty system turn, inserted by the chat template", False
    return "none", False


def pace_line(first: dict[str, float], steps_left: int, evals_left: int) -> str:
    """After the run's first step: what it cost by phase, and the rest of the run at that pace (the first
    step has no Adam state yet and responses change length as the policy learns: an estimate)."""
    phases = [(k.removeprefix("timing/").removesuffix("_s"), v) for k, v in first.items()
              if k.startswith("timing/") and k not in ("timing/step_s", "timing/eval_s") and v >= 0.05]
    split = ", ".join(f"{name} {v:.1f}" for name, v in sorted(phases, key=lambda p: -p[1]))
    step_s, eval_s = first.get("timing/step_s", 0.0), first.get("timing/eval_s", 0.0)
    rest = steps_left * step_s + evals_left * eval_s
    evals = f" + {evals_left} evaluation(s) of {_duration(eval_s)}" if evals_left and eval_s else ""
    return (f"the first step took {step_s:.1f} s ({split}); the {steps_left} step(s) left{evals}: about "
            f"{_duration(rest)} at this pace")


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"

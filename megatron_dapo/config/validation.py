"""Cross-field and range checks of a config, all problems reported at once, before anything heavy loads."""

from __future__ import annotations

import os

from megatron_dapo.config.model_checks import model_problems
from megatron_dapo.config.ranges import range_problems
from megatron_dapo.config.tools import ToolsConfig, tools_problems
from megatron_dapo.config.schema import (
    POLICY_LOSSES,
    PROMPT_TEMPLATES,
    REWARD_FUNCTION,
    REWARDS,
    AlgoConfig,
    Config,
    ConfigError,
)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Range and cross-field checks; raises ConfigError listing every problem found, on one line."""
    problems = _problems(cfg)
    if world_size is not None:  # the layout: against the world size and the model's config.json
        problems += _layout_problems(cfg, world_size) + model_problems(cfg) + _lagged_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems), tuple(problems))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)


def _problems(cfg: Config) -> list[str]:
    """The range of every numeric field (config/ranges.py), then the checks across fields."""
    p = range_problems(cfg)
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    p += _prompt_problems(cfg)
    if t.prompt_batch_size % max(t.mini_batch_size, 1):
        p.append(f"train.mini_batch_size={t.mini_batch_size} must divide "
                 f"train.prompt_batch_size={t.prompt_batch_size}")
    p += _correction_problems(a, cfg.rollout_correction()) + _policy_loss_problems(a) + _async_problems(cfg)
    p += _tools_problems(cfg) + _r3_problems(cfg)
    if cfg.reward.soft_overlong_punishment and not 0 < cfg.reward.overlong_cache_len < r.max_response_len:
        p.append(f"reward.overlong_cache_len={cfg.reward.overlong_cache_len} must be in "
                 f"(0, rollout.max_response_len={r.max_response_len})")
    if r.engine == "sglang" and r.colocate and r.sglang.weight_sync == "distributed":
        p.append("rollout.sglang.weight_sync=distributed with rollout.colocate=true puts trainer rank 0 and "
                 "each server's TP rank 0 on one GPU in one NCCL communicator, which NCCL refuses (Duplicate "
                 "GPU): use weight_sync=tensor (CUDA IPC) for colocated servers, or rollout.colocate=false")
    if r.partial_rollout and not r.streaming:
        p.append("rollout.partial_rollout needs rollout.streaming=true (it continues the groups a stream aborts)")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_parallel == 1:
        p.append("parallel.sequence_parallel needs parallel.tensor_parallel > 1")
    if cfg.parallel.sequence_parallel and cfg.actor.loss_impl == "linear":
        p.append("actor.loss_impl=linear does not support parallel.sequence_parallel (use logits or auto)")
    if cfg.actor.shared_prefix is True and cfg.model.transformer_impl == "transformer_engine":
        p.append("actor.shared_prefix=on needs model.transformer_impl=local (Transformer Engine's causal "
                 "attention ignores the block mask; auto turns it off)")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        p.append(f"checkpoint.resume={resume!r} must be auto, none or an existing checkpoint folder")
    if cfg.reward.name not in REWARDS and not REWARD_FUNCTION.fullmatch(cfg.reward.name):
        p.append(f"reward.name={cfg.reward.name!r} must be one of {', '.join(REWARDS)} "
                 "or module.path:function")
    return p


def _r3_problems(cfg: Config) -> list[str]:
    """actor.routing_replay=r3 trains on the routes each sample's rollout returned: tools are refused (an
    observation's tokens are not generated: the engine routes them only when the next turn reads them)."""
    if cfg.actor.routing_replay != "r3" or cfg.rollout.tools.name == "none":
        return []
    return ["actor.routing_replay=r3 does not work with rollout.tools (an observation's tokens are routed when the "
            "next turn reads them) yet: use routing_replay=r2"]


def _tools_problems(cfg: Config) -> list[str]:
    """rollout.tools, and the features a multi-turn sample cannot go through yet, refused by name."""
    tools, r = cfg.rollout.tools, cfg.rollout
    says_tools = cfg.data.prompt_template == "dapo_math_tool"
    if not tools.enabled:
        return (["algo.void_turn_filter needs rollout.tools (a single-turn sample has no turns)"]
                if cfg.algo.void_turn_filter else []) + \
            (["data.prompt_template=dapo_math_tool tells the model it may run Python, but rollout.tools.name=none: "
              "set rollout.tools.name=python (or use data.prompt_template=dapo_math)"] if says_tools else [])
    p = tools_problems(tools)
    default = ToolsConfig()
    if says_tools and (tools.code_open, tools.output_open) != (default.code_open, default.output_open):
        p.append("data.prompt_template=dapo_math_tool names the default fences (```python, ```output): keep "
                 "rollout.tools.code_open / output_open, or give your fences in a template file")
    refused = [(r.streaming, "rollout.streaming=true (set rollout.streaming=false: synchronous rounds)"),
               (r.partial_rollout, "rollout.partial_rollout"),
               (r.async_steps > 0, f"rollout.async_steps={r.async_steps} (the off-policy pipelines)"),
               (cfg.rollout_correction() != "none", f"algo.rollout_correction={cfg.rollout_correction()}")]
    p += [f"rollout.tools.name={tools.name} does not support {what} yet" for bad, what in refused if bad]
    return p


def _policy_loss_problems(a: AlgoConfig) -> list[str]:
    """The loss's name, and the settings each built-in variant takes (a user's loss is checked on import)."""
    kind = a.policy_loss
    if kind not in POLICY_LOSSES and not REWARD_FUNCTION.fullmatch(kind):
        return [f"algo.policy_loss={kind!r} must be one of {', '.join(POLICY_LOSSES)} "
                "or module.path:function"]
    p: list[str] = []
    if kind == "cispo":
        if a.eps_low is not None:
            p.append(f"algo.eps_low={a.eps_low}: cispo's weight min(r, eps_high) has no lower bound; "
                     "leave it unset")
        if a.eps_high is not None and not a.eps_high >= 1:
            p.append(f"algo.eps_high={a.eps_high} with algo.policy_loss=cispo caps the weight "
                     "min(r, eps_high) itself (not 1 + eps): use a value >= 1 (ScaleRL, the default: 5)")
        if a.clip_ratio_c is not None:
            p.append("algo.clip_ratio_c: cispo has no dual clip (its weight is capped already); "
                     "leave it unset")
    if kind == "dr_grpo" and a.loss_agg_mode != "token-mean":
        p.append(f"algo.loss_agg_mode={a.loss_agg_mode} does not apply to algo.policy_loss=dr_grpo, which "
                 "divides the token sums by sequences x rollout.max_response_len: leave it token-mean")
    return p


def _async_problems(cfg: Config) -> list[str]:
    """rollout.async_steps: the engine on its own devices, pi_old recomputed by the actor."""
    r = cfg.rollout
    if not r.async_steps:
        return [("rollout.async_mode=stream needs off-policy pipelining: set rollout.async_steps >= 1 (the "
                 "staleness bound)")] if r.async_mode == "stream" else []
    p: list[str] = []
    if r.colocate:
        p.append(f"rollout.async_steps={r.async_steps} overlaps generation with training, which needs the engine on "
                 "its own devices: set rollout.colocate=false (or async_steps=0)")
    if r.async_mode == "stream" and not r.streaming:
        p.append("rollout.async_mode=stream interrupts the batch in production with new weights, which needs the "
                 "group stream: set rollout.streaming=true (or async_mode=batch)")
    if cfg.algo.old_logprob_source == "rollout":
        p.append(f"rollout.async_steps={r.async_steps} with algo.old_logprob_source=rollout: the batch comes "
                 "from an older policy, pi_old must be the actor's recompute (old_logprob_source=recompute)")
    return p


def _lagged_problems(cfg: Config, world_size: int) -> list[str]:
    """async_steps >= 2 hands each step's weights to the engine later, from the producer thread of the one
    rank that feeds it: the embedded engine (the driver's), or SGLang servers fed by a one-rank job."""
    r = cfg.rollout
    if not r.lagged or r.engine != "sglang" or world_size == 1:
        return []
    return [(f"rollout.async_steps={r.async_steps} async_mode={r.async_mode} with SGLang needs a one-rank job (every "
             f"rank of {world_size} takes part in updating the servers, at the batch boundary only): use "
             "rollout.async_steps=1 async_mode=batch")]


def _correction_problems(a: AlgoConfig, correction: str) -> list[str]:
    """Dual-clip and rollout-correction ranges."""
    p: list[str] = []
    high, low = a.rollout_correction_threshold, a.rollout_correction_threshold_low
    if not high > 0:  # reported by its range
        pass
    elif low is not None and not 0 < low < high:
        p.append(f"algo.rollout_correction_threshold_low={low} must be in "
                 f"(0, algo.rollout_correction_threshold={high})")
    elif low is None and correction.endswith("_mis") and not high > 1:
        p.append(f"algo.rollout_correction_threshold={high} must be > 1 for {correction} "
                 "(the default band's lower end is 1 / threshold)")
    if correction != "none" and a.old_logprob_source == "rollout" and a.rollout_correction != "auto":
        p.append(f"algo.rollout_correction={correction} with algo.old_logprob_source=rollout: "
                 "pi_old is the rollout policy then, so every correction weight would be 1")
    return p


def _prompt_problems(cfg: Config) -> list[str]:
    """Prompt template, few-shot file, chat template, sample logging and the model's kernels: names and files
    exist, and the kernels asked for exist in the layer spec asked for."""
    p: list[str] = []
    d, m = cfg.data, cfg.model
    if d.prompt_template not in PROMPT_TEMPLATES and not os.path.isfile(d.prompt_template):
        p.append(f"data.prompt_template={d.prompt_template!r} must be one of {list(PROMPT_TEMPLATES)} or a "
                 "template file")
    if d.few_shot_path is not None and not os.path.isfile(d.few_shot_path):
        p.append(f"data.few_shot_path={d.few_shot_path!r}: no such file")
    if m.chat_template not in ("auto", "none") and not os.path.isfile(m.chat_template):
        p.append(f"model.chat_template={m.chat_template!r} must be auto, none or a Jinja file")
    if m.moe_experts == "grouped" and m.transformer_impl == "local":
        p.append("model.moe_experts=grouped runs Transformer Engine's GroupedLinear, which the local layer spec "
                 "(model.transformer_impl=local) does not have: set model.moe_experts=auto or sequential")
    if d.prompt_template == "gsm8k" and cfg.reward.name in REWARDS and cfg.reward.answer_fallback == "none":
        p.append("data.prompt_template=gsm8k asks for the answer after '####', which reward.answer_fallback=none "
                 "never reads: set reward.answer_fallback=boxed (or use the dapo_math template)")
    return p


def _layout_problems(cfg: Config, world_size: int) -> list[str]:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size % (tp * pp):
        start = (f": start {tp * pp} processes, e.g. torchrun --nproc_per_node {tp * pp} -m megatron_dapo.train ..."
                 if world_size == 1 else "")
        return [f"TP({tp}) x PP({pp}) = {tp * pp} does not divide world size {world_size}{start}"]
    dp = data_parallel_size(cfg, world_size)
    ep = cfg.parallel.expert_parallel
    if ep > 0 and dp % ep:
        return [f"parallel.expert_parallel={ep} must divide DP={dp} (world {world_size} / TP {tp} / PP {pp}): "
                f"the experts are split over data-parallel ranks"]
    if cfg.train.mini_batch_size % dp:
        return [f"train.mini_batch_size={cfg.train.mini_batch_size} must divide by DP={dp} "
                f"(world {world_size} / TP {tp} / PP {pp})"]
    return []

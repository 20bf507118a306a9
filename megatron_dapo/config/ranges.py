"""The valid range of every numeric field of the config tree, in one table (interval notation).

`range_problems(cfg)` checks each value against its interval: NaN is never inside one, and `inf` only
where the interval is closed at infinity (none is). A field that is None where its type allows None is
not checked. tests/test_config_ranges.py walks the dataclasses and fails when a numeric field has no
entry here, so a new field cannot skip this check.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

INF = math.inf

# key -> (interval, optional reason shown after the message)
RANGES: dict[str, tuple[str, str]] = {
    "parallel.tensor_parallel": ("[1, inf)", ""),
    "parallel.pipeline_parallel": ("[1, inf)", ""),
    "parallel.expert_parallel": ("[1, inf)", ""),
    "parallel.timeout_s": ("(0, inf)", ""),
    "actor.optimizer.lr": ("(0, 1]", "an AdamW step moves every weight by about lr; the paper uses 1e-6"),
    "actor.optimizer.warmup_steps": ("[0, inf)", ""),
    "actor.optimizer.weight_decay": ("[0, inf)", ""),
    "actor.optimizer.grad_clip": ("[0, inf)", "0 disables clipping"),
    "actor.optimizer.adam_beta1": ("[0, 1)", ""),
    "actor.optimizer.adam_beta2": ("[0, 1)", ""),
    "actor.optimizer.adam_eps": ("(0, inf)", ""),
    "actor.micro_batch_tokens": ("[0, inf)", "0 = sized from the vocabulary"),
    "actor.logprob_micro_batch_tokens": ("[0, inf)", "0 = sized from the vocabulary"),
    "rollout.max_prompt_len": ("[1, inf)", ""),
    "rollout.max_response_len": ("[1, inf)", ""),
    "rollout.temperature": ("[0, inf)", "0 = greedy"),
    "rollout.top_p": ("(0, 1]", ""),
    "rollout.weight_sync_bucket_mb": ("[1, inf)", ""),
    "rollout.max_inflight_groups": ("[0, inf)", "0 = automatic"),
    "rollout.max_carry_steps": ("[0, inf)", "0 = no bound"),
    "rollout.sglang.mem_fraction_static": ("(0, 1)", ""),
    "rollout.sglang.tensor_parallel": ("[1, inf)", ""),
    "rollout.sglang.num_servers": ("[0, inf)", "0 = fill the node"),
    "rollout.sglang.base_port": ("[1, 65535]", ""),
    "rollout.sglang.startup_timeout_s": ("(0, inf)", ""),
    "rollout.sglang.request_timeout_s": ("(0, inf)", ""),
    "reward.overlong_cache_len": ("[0, inf)", ""),
    "reward.overlong_penalty_factor": ("[0, inf)", ""),
    "reward.timeout_s": ("[0, inf)", "0 = no limit"),
    "algo.group_size": ("[2, inf)", "group advantages need G >= 2"),
    "algo.eps_low": ("[0, 1)", "or null for the policy loss's default"),
    "algo.eps_high": ("[0, inf)", "or null for the policy loss's default"),
    "algo.kl_coef": ("[0, inf)", ""),
    "algo.entropy_coef": ("(-inf, inf)", ""),
    "algo.max_gen_rounds": ("[1, inf)", ""),
    "algo.gen_batch_multiplier": ("[1, inf)", ""),
    "algo.epochs_per_rollout": ("[1, inf)", ""),
    "algo.clip_ratio_c": ("(1, inf)", "or null for no dual-clip"),
    "algo.rollout_correction_threshold": ("(0, inf)", ""),
    "algo.rollout_correction_threshold_low": ("(0, inf)", ""),
    "data.max_prompt_chars": ("[1, inf)", ""),
    "eval.every_steps": ("[0, inf)", "0 = never"),
    "eval.n_samples": ("[1, inf)", ""),
    "eval.temperature": ("[0, inf)", ""),
    "eval.top_p": ("(0, 1]", ""),
    "eval.max_prompts": ("[1, inf)", ""),
    "train.steps": ("[1, inf)", ""),
    "train.prompt_batch_size": ("[1, inf)", ""),
    "train.mini_batch_size": ("[1, inf)", ""),
    "train.seed": ("[0, inf)", ""),
    "train.rollout_budget": ("[0, inf)", "0 = no limit"),
    "checkpoint.save_every": ("[0, inf)", "0 = only at the end"),
    "checkpoint.keep_last": ("[1, inf)", ""),
    "logging.entropy_collapse_frac": ("[0, 1]", ""),
    "logging.samples_every": ("[0, inf)", "0 = never (evaluations still write theirs)"),
    "logging.samples_per_step": ("[0, inf)", ""),
    "logging.length_blowup_frac": ("(0, 1]", ""),
}


class Interval(typing.NamedTuple):
    low: float
    high: float
    low_open: bool
    high_open: bool

    def __contains__(self, v: float) -> bool:  # NaN compares False: never inside
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def describe(self) -> str:
        if self.high == INF:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}" if self.low != -INF else "finite"
        return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_interval(text: str) -> Interval:
    """'[0, 1)' -> Interval(0, 1, low_open=False, high_open=True); 'inf' ends are always open."""
    low, high = (float(part) for part in text[1:-1].split(","))
    return Interval(low, high, text[0] == "(", text[-1] == ")")


def numeric_fields(obj: Any, prefix: str = "") -> dict[str, Any]:
    """dotted key -> value of every int / float (or optional int / float) field under the dataclass `obj`."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            out.update(numeric_fields(value, f"{prefix}{f.name}."))
        elif _is_numeric(tp):
            out[f"{prefix}{f.name}"] = value
    return out


def _is_numeric(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_numeric(a) for a in typing.get_args(tp) if a is not type(None))
    return tp in (int, float)


def range_problems(cfg: Any) -> list[str]:
    """One line per numeric field of `cfg` outside its interval (or without one: a bug)."""
    problems = []
    for key, value in numeric_fields(cfg).items():
        if key not in RANGES:
            problems.append(f"{key}: no valid range declared (megatron_dapo/config/ranges.py)")
            continue
        if value is None:
            continue
        interval_text, why = RANGES[key]
        interval = parse_interval(interval_text)
        if value not in interval:
            problems.append(f"{key}={value} must be {interval.describe()}" + (f" ({why})" if why else ""))
    return problems

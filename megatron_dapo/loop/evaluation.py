"""Evaluation with k samples per prompt: avg@k, pass@k and maj@k, one JSON record per prompt.

The in-training validation (`validate`) and `python -m megatron_dapo.evaluate` both run
`generate_and_score` + `EvalResult`, so a number from one means the same as from the other. Generation
streams (the engine's `RolloutStream`: continuous batching on the embedded engine, one request per group
on SGLang): every group is scored as soon as its k samples are done and reported to a progress callback.
Prompt i draws from its own seed, so its samples do not depend on what finishes first.

- avg@k: mean accuracy over all k samples of all prompts (the paper's avg@32).
- pass@j: chance that at least one of j samples drawn without replacement from a prompt's k is
  correct, by the unbiased estimator of Chen et al. 2021, 1 - C(k-c, j) / C(k, j), averaged over
  prompts; reported for j = 1, 2, 4, ... < k and j = k (pass@1 = avg@k).
- maj@k: the most frequent extracted answer (ties: the one seen first; samples with none do not
  vote) is correct.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.config import Config
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.reward.scorer import Scorer
from megatron_dapo.rollout.base import GroupRequest, RolloutEngine, SamplingParams
from megatron_dapo.rollout.tools.monitors import tool_scalars
from megatron_dapo.collect.scoring import score_group
from megatron_dapo.collect.seeds import sampling_params
from megatron_dapo.types import Group, Prompt, Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, eq. 1),
    in exact integer arithmetic up to the final division."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def pass_ks(n: int) -> list[int]:
    """The j of the reported pass@j: powers of two below n, and n."""
    return [2**i for i in range(max(n - 1, 0).bit_length()) if 2**i < n] + [n]


def majority(samples: Sequence[Sample]) -> tuple[str | None, bool]:
    """(the majority answer, whether it is correct); (None, False) when no sample has an answer."""
    votes = Counter(s.pred for s in samples if s.pred is not None)
    if not votes:
        return None, False
    pred = votes.most_common(1)[0][0]
    return pred, any(s.acc for s in samples if s.pred == pred)


def generate_and_score(engine: RolloutEngine, tokenizer: Any, prompts: Sequence[Prompt], n: int,
                       sampling: Callable[[int], SamplingParams], scorer: Scorer, *,
                       on_group: Callable[[Group], None] | None = None) -> list[Group]:
    """n scored samples per prompt, in prompt order; `sampling(i)` is prompt i's (its seed). Streamed: each
    group is scored as it finishes and handed to `on_group` (a progress bar) in completion order."""
    requests = [GroupRequest(key=i, prompt_ids=render_prompt_ids(tokenizer, p), n=n, sampling=sampling(i))
                for i, p in enumerate(prompts)]
    done: dict[int, Group] = {}
    with engine.stream() as stream:
        if requests:
            stream.submit(requests)
        while stream.pending:
            result = stream.next()
            group = Group(prompt=prompts[result.key], samples=result.samples)
            score_group(group, tokenizer, scorer)
            done[result.key] = group
            if on_group is not None:
                on_group(group)
    return [done[i] for i in range(len(prompts))]


def validate(engine: RolloutEngine, tokenizer: Any, prompts: list[Prompt], cfg: Config, eos_ids: tuple[int, ...],
             scorer: Scorer) -> EvalResult:
    """k = eval.n_samples scored samples per validation prompt (eval temperature / top-p, prompt i's seed)."""
    t0 = time.perf_counter()
    groups = generate_and_score(engine, tokenizer, prompts, cfg.eval.n_samples,
                                lambda i: sampling_params(cfg, eos_ids, "eval", i), scorer)
    return EvalResult(groups, cfg.eval.n_samples, seconds=time.perf_counter() - t0)


@dataclass
class EvalResult:
    """Scored groups of one evaluation and their metrics."""

    groups: list[Group]
    n: int
    seconds: float = 0.0
    ks: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ks = pass_ks(self.n)

    def summary(self) -> dict[str, float]:
        """{avg@n, pass@j..., maj@n, response_length_mean, truncated_frac, prompts, samples}."""
        samples = [s for g in self.groups for s in g.samples]
        out = {f"avg@{self.n}": _mean([float(s.acc) for s in samples])}
        for k in self.ks:
            out[f"pass@{k}"] = _mean([pass_at_k(len(g.samples), g.num_correct, k) for g in self.groups])
        out[f"maj@{self.n}"] = _mean([float(majority(g.samples)[1]) for g in self.groups])
        out["response_length_mean"] = _mean([s.response_len for s in samples])
        out["truncated_frac"] = _mean([float(s.truncated) for s in samples])
        out["prompts"], out["samples"] = float(len(self.groups)), float(len(samples))
        return out

    def val_scalars(self) -> dict[str, float]:
        """The in-training monitors: val/acc_avg_at_k, val/pass_at_k, val/maj_at_k, val/response_length_mean; with
        a tool (rollout.tools), val/tool_calls_per_sample and val/void_turn_frac too."""
        s = self.summary()
        tools = tool_scalars([x for g in self.groups for x in g.samples])
        return {"val/acc_avg_at_k": s[f"avg@{self.n}"], "val/pass_at_k": s[f"pass@{self.n}"],
                "val/maj_at_k": s[f"maj@{self.n}"], "val/response_length_mean": s["response_length_mean"],
                **({"val/tool_calls_per_sample": tools["tool/calls_per_sample"],
                    "val/void_turn_frac": tools["rollout/void_turn_frac"]} if tools else {})}

    def prompt_records(self) -> list[dict[str, Any]]:
        """One JSON-able record per prompt: its counts, metrics and every response."""
        rows = []
        for g in self.groups:
            pred, maj_ok = majority(g.samples)
            rows.append({
                "uid": g.prompt.uid, "data_source": g.prompt.data_source, "prompt": g.prompt.messages[-1]["content"],
                "ground_truth": g.prompt.ground_truth, "n": len(g.samples), "correct": g.num_correct,
                "avg": g.num_correct / max(len(g.samples), 1), "maj_pred": pred, "maj_correct": maj_ok,
                **{f"pass@{k}": pass_at_k(len(g.samples), g.num_correct, k) for k in self.ks if k <= len(g.samples)},
                "responses": [{"response": s.response_text, "pred": s.pred, "acc": s.acc, "reward": s.reward,
                               "length": s.response_len, "finish_reason": s.finish_reason} for s in g.samples]})
        return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0

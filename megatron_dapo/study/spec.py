"""What a study runs: the variants (Table 1's cumulative rows and single-switch contrasts), the seeds,
the equal rollout budget, and the config every run starts from."""

from __future__ import annotations

from dataclasses import dataclass

TABLE1: list[tuple[str, str, list[str]]] = [
    ("grpo", "naive GRPO", ["algo.eps_high=0.2", "algo.loss_agg_mode=seq-mean-token-mean",
                            "algo.overlong_filtering=false", "reward.soft_overlong_punishment=false",
                            "algo.dynamic_sampling=false"]),
    ("overlong_filter", "+ overlong filtering", ["algo.overlong_filtering=true"]),
    ("clip_higher", "+ clip-higher", ["algo.eps_high=0.28"]),
    ("soft_overlong", "+ soft overlong punishment", ["reward.soft_overlong_punishment=true"]),
    ("token_loss", "+ token-level loss", ["algo.loss_agg_mode=token-mean"]),
    ("dapo", "+ dynamic sampling (DAPO)", ["algo.dynamic_sampling=true"]),
]
"""Table 1 of the paper, cumulative: each row adds one technique to the one before (key, label, delta).
Settings no row names (filter_metric=acc, answer_fallback=none, no dual clip, no KL) are the same in
every row; filter_metric only acts where dynamic sampling is on."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    key: str
    """Names the run folders and result files ("grpo", "dapo", ...)."""
    label: str
    overrides: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Contrast:
    """Two variants that differ in one switch: `off` without the technique, `on` with it."""

    label: str
    off: str
    on: str


@dataclass(frozen=True, kw_only=True)
class Study:
    name: str
    config: str
    """The config every run starts from (repository-relative)."""
    base: str
    """Which base model the config's model.hf_dir holds, built on first use: "tiny", "steps" or "tool"."""
    seeds: tuple[int, ...]
    budget: int
    """Responses generated per run (train.rollout_budget): the equal rollout budget."""
    target: float
    """Validation accuracy for the steps-to-target column."""
    variants: tuple[Variant, ...]
    contrasts: tuple[Contrast, ...] = ()
    overrides: tuple[str, ...] = ()
    """Applied to every run, after the config and before the variant."""
    max_steps: int = 1000
    """Upper bound on steps (the budget stops every run first)."""
    late: tuple[tuple[str, str], ...] = ()
    """(tag, column label) of more per-step monitors the table and the contrasts report (their late mean)."""
    panels: tuple[tuple[str, str, str], ...] = ()
    """The figure's panels (tag, x = "step" or a cumulative tag, y label); () = the paper's (report.PANELS)."""


def merged(*deltas: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The dotted overrides of `deltas` merged, a later value of a key replacing an earlier one."""
    out: dict[str, str] = {}
    for delta in deltas:
        out.update(dict(o.split("=", 1) for o in delta))
    return tuple(f"{k}={v}" for k, v in out.items())


def table1_variants() -> list[Variant]:
    """Table 1's rows; row i holds every delta up to i."""
    return [Variant(key=key, label=label, overrides=merged(*(d for _, _, d in TABLE1[: i + 1])))
            for i, (key, label, _) in enumerate(TABLE1)]


def dapo_small() -> Study:
    """The DAPO study on the multi-step task: Table 1's six rows, plus DAPO with eps_high=0.2 for the
    clip-higher contrast; the dynamic-sampling contrast reuses two rows of Table 1 ("+ token-level
    loss" is DAPO without dynamic sampling), so 7 variants in all."""
    rows = table1_variants()
    eps_low_only = Variant(key="dapo_eps0.2", label="DAPO with eps_high=0.2",
                           overrides=merged(rows[-1].overrides, ["algo.eps_high=0.2"]))
    return Study(name="dapo-small", config="examples/configs/study_dapo_small.yaml", base="steps", seeds=(1, 2, 3),
                 budget=12288, target=0.5, variants=(*rows, eps_low_only),
                 contrasts=(Contrast(label="clip-higher: eps_high 0.2 -> 0.28 (rest DAPO)", off="dapo_eps0.2",
                                     on="dapo"),
                            Contrast(label="dynamic sampling: off -> on (rest DAPO)", off="token_loss", on="dapo")))


def tiny() -> Study:
    """Table 1 on the tiny arithmetic task of the embedded default (a flat result, kept for reference)."""
    return Study(name="tiny", config="examples/configs/tiny_cpu.yaml", base="tiny", seeds=(1, 2, 3), budget=8192,
                 target=0.65, variants=tuple(table1_variants()),
                 overrides=("eval.every_steps=4", "rollout.streaming=false"))  # rounds, as it was measured


def tool() -> Study:
    """Tool-integrated DAPO on the tool base (3-digit products; a Python block in 40% of its warm-start answers):
    accuracy and the tool-call rate over training, and SimpleTIR's void-turn filter on DAPO (off -> on)."""
    calls, void = "tool/calls_per_sample", "rollout/void_turn_frac"
    dapo = Variant(key="dapo", label="DAPO with the Python tool", overrides=("algo.void_turn_filter=false",))
    void_filter = Variant(key="dapo_void", label="+ void-turn filter (SimpleTIR)",
                          overrides=("algo.void_turn_filter=true",))
    return Study(name="tool", config="examples/configs/tiny_tool_cpu.yaml", base="tool", seeds=(1, 2, 3),
                 budget=TOOL_BUDGET, target=0.4, variants=(dapo, void_filter),
                 contrasts=(Contrast(label="void-turn filter: off -> on (rest DAPO)", off="dapo", on="dapo_void"),),
                 overrides=TOOL_OVERRIDES,
                 late=((calls, "tool calls / sample"), (void, "void-turn frac"), ("tool/error_frac", "tool error frac"),
                       ("train/acc_mean", "train acc")),
                 panels=(("val/acc_avg_at_k", "step", "validation accuracy (avg@k)"),
                         ("train/acc_mean", "step", "training accuracy (sampled)"),
                         (calls, "step", "tool calls per sample (training)"),
                         ("val/tool_calls_per_sample", "step", "tool calls per sample (validation)"),
                         (void, "step", "void-turn fraction (training)"),
                         ("response_length/mean", "step", "mean response length (tokens)")))


TOOL_BUDGET = 6144
"""Responses per run of the tool study: 48 rounds of 16 prompts x 8 (about 25 steps under dynamic sampling)."""
TOOL_OVERRIDES = ("train.prompt_batch_size=16", "train.mini_batch_size=8", "eval.every_steps=3", "eval.max_prompts=32")
"""The tool study's runs: half the config's batch (two CPU cores), evaluated every 3 steps."""


STUDIES = {"dapo-small": dapo_small, "tiny": tiny, "tool": tool}

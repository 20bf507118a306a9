"""The disaggregated plan's text report: the split, the step-time estimate, the splits considered, the
assumptions; then the training side's full report (plan/report.py), whose verdict ends it."""

from __future__ import annotations

from megatron_dapo.plan.core import fmt_gib
from megatron_dapo.plan.cost import Estimate
from megatron_dapo.plan.report import fmt_count, format_plan
from megatron_dapo.plan.split import Disaggregated, SplitOption


def format_disaggregated(d: Disaggregated) -> str:
    hw = d.cluster
    mode = (f"rollout.async_steps={d.async_steps}: pipelined" if d.async_steps >= 1
            else "rollout.async_steps=0: synchronous")
    lines = [f"disaggregated plan: {d.config} on {hw.nodes} node(s) x {hw.gpus_per_node} GPUs = "
             f"{hw.world_size} GPUs of {hw.gpu_mem_gib:g} GiB (rollout.colocate=false, {mode})"]
    chosen = d.chosen
    if chosen is not None and chosen.estimate is not None:
        lines += _split_lines(chosen) + _time_lines(d, chosen.estimate)
    lines += _options_lines(d) + ["", "assumptions"] + [f"  - {a}" for a in d.assumptions]
    if chosen is not None:
        return "\n".join(lines + ["", "the training side (the engine sized on the generation GPUs):",
                                  format_plan(chosen.plan)])
    return "\n".join([*lines, "", "verdict: REFUSED (no split fits)", *[f"  - {p}" for p in d.problems]])


def _split_lines(o: SplitOption) -> list[str]:
    lay, pool, hw = o.plan.layout, o.plan.rollout.sglang, o.split.generate.hardware
    assert pool is not None
    return [
        f"  train     {o.split.train.describe()}: {o.split.train.gpus} GPUs, actor TP={lay.tp} x PP={lay.pp} "
        f"x DP={lay.dp}",
        f"  generate  {o.split.generate.describe()}: {o.split.generate.gpus} GPUs, {pool.engines} SGLang "
        f"engines x TP={pool.sglang_tp} ({pool.engines_per_node} per node); per GPU weights "
        f"{fmt_gib(pool.weights)} + KV pool {fmt_gib(pool.kv_pool)} GiB = mem_fraction_static x "
        f"{hw.gpu_mem_gib:g} GiB; {pool.worst_case_sequences_in_flight} worst-case sequences in flight per "
        f"engine",
    ]


def _time_lines(d: Disaggregated, e: Estimate) -> list[str]:
    g, t, s, step = e.generation, e.train, e.sync, e.step
    pipelined = ("max(generation, training) + weight sync" if d.async_steps >= 1
                 else "max(generation, training) + weight sync with rollout.async_steps=1")
    return [
        "",
        f"step time (estimated, seconds; the least {d.objective} step of the splits that fit)",
        f"  generation  {g.seconds:>10.1f}   {g.rounds:g} round(s) x (decode {g.waves} wave(s) x "
        f"{g.decode_steps // g.waves} steps x {g.step_s * 1e3:.2f} ms, {g.bound}-bound: "
        f"{g.bytes_per_step / 1e9:.1f} GB read per GPU, {g.concurrent} sequences at once of "
        f"{g.sequences_per_engine} per engine; + prefill {g.prefill_s:.1f})",
        f"  training    {t.seconds:>10.1f}   {t.flops_per_param_token} x {fmt_count(t.params)} params x "
        f"{fmt_count(t.tokens)} tokens / ({t.gpus} GPUs x {d.throughput.peak_tflops:g} TFLOP/s x MFU "
        f"{d.throughput.mfu:g})",
        f"  weight sync {s.seconds:>10.1f}   refit {s.refit_s:.2f} + {s.model_bytes / 1e9:.1f} GB over "
        f"{s.link} {s.transfer_s:.2f}",
        f"  synchronous {step.synchronous:>10.1f}   generation + training + weight sync",
        f"  pipelined   {step.pipelined:>10.1f}   {pipelined}",
        f"  ratio       {step.ratio:>10.3f}   pipelined / synchronous (limit max / sum = {step.limit:.3f})",
    ]


def _options_lines(d: Disaggregated) -> list[str]:
    lines = ["", "splits considered (train GPUs | generate GPUs: estimated synchronous / pipelined seconds)"]
    chosen = d.chosen
    for o in d.options:
        mark = "*" if o is chosen else " "
        head = f"  {mark} {o.split.train.gpus:>4} | {o.split.generate.gpus:<4}"
        if o.estimate is None:
            first, more = o.plan.problems[0], len(o.plan.problems) - 1
            first = first if len(first) <= 80 else first[:77] + "..."
            lines.append(f"{head}  refused: {first}{f' (+{more} more)' if more else ''}")
        else:
            step = o.estimate.step
            lines.append(f"{head}  {step.synchronous:.1f} / {step.pipelined:.1f}")
    return lines

"""The planner's disaggregated layout (rollout.colocate=false, plan/split.py + plan/cost.py): the split it
chooses and its step-time estimate against hand arithmetic, refusals that name every split, the JSON fields,
and colocated configs untouched. Fast: no torch.distributed, no GPU."""

import json
import math
import re
from pathlib import Path

import pytest

from megatron_dapo import plan as P
from megatron_dapo.config import load_config
from megatron_dapo.plan.cli import main as plan_main
from megatron_dapo.plan.cost import StepTimes, Throughput, Workload
from megatron_dapo.plan.report import format_plan
from megatron_dapo.plan.split import candidate_splits, plan_disaggregated

REPO = Path(__file__).resolve().parents[1]
CFG_32B = REPO / "examples/configs/dapo_qwen2.5_32b.yaml"
GIB = 2**30

# Qwen2.5-1.5B by hand (public config.json): h=1536, ffn=8960, 28 layers, 12 heads x 128, 2 KV heads, vocab
# 151936, tied embeddings; trained at TP=1 on k GPUs of one 8-GPU H100 node, SGLang TP=1 on the other 8-k.
H, FFN, L, KVD, V = 1536, 8960, 28, 2 * 128, 151936
PARAMS = L * (H * (H + 2 * KVD) + (H + 2 * KVD) + H * H + 3 * H * FFN + 2 * H) + V * H + H
SMALL = ["rollout.colocate=false", "model.hf_dir=/m/Qwen2.5-1.5B", "parallel.tensor_parallel=1",
         "parallel.sequence_parallel=false", "rollout.sglang.tensor_parallel=1"]
P_LEN, R_LEN = 1024, 4096
FLOPS = 989e12 * 0.4  # the default peak x MFU
HBM = 3350e9 * 0.7  # the default HBM bandwidth x the fraction a decode step reaches


def split_plan(nodes, gpus=8, overrides=(), mem=80.0, prompt=P_LEN, response=R_LEN, config=CFG_32B):
    cfg = load_config(config, list(overrides))
    spec, _ = P.resolve_model(cfg)
    return plan_disaggregated(cfg, spec, P.Hardware(nodes=nodes, gpus_per_node=gpus, gpu_mem_gib=mem),
                              work=Workload.of(cfg, prompt, response))


def hand_step(train_gpus: int, refit_s: float) -> StepTimes:
    """The 1.5B case by the formulas of plan/cost.py's docstring, from the config's numbers."""
    tokens = 512 * 16 * (P_LEN + R_LEN)  # prompt_batch_size x G sequences
    training = (6 + 2 + 2) * PARAMS * tokens / (train_gpus * FLOPS)  # recompute=full, pi_old recomputed
    engines = 8 - train_gpus
    seqs = math.ceil(1536 * 16 / engines)  # gen_batch_multiplier 3 x 512 prompts x G
    kv_token = 2 * L * 2 * 128 * 2  # K and V, 2 KV heads x 128, bf16
    pool_tokens = int((0.6 * 80 * GIB - 2 * PARAMS) // kv_token)
    at_once = min(seqs, pool_tokens // (P_LEN + R_LEN))
    read = 2 * PARAMS + at_once * (P_LEN + R_LEN / 2) * kv_token
    step = max(read / HBM, 2 * PARAMS * at_once / FLOPS)
    decode = math.ceil(seqs / at_once) * R_LEN * step
    prefill = 2 * PARAMS * math.ceil(1536 / engines) * P_LEN / FLOPS
    return StepTimes(generation=decode + prefill, training=training, sync=refit_s + 2 * PARAMS / 450e9)


@pytest.mark.parametrize("async_steps, chosen", [(0, 4), (1, 2)])
def test_the_split_with_the_least_step_time_by_hand(async_steps, chosen):
    """One node: k GPUs train (DP=k must divide the 32-prompt mini-batch: k = 1, 2, 4), 8-k generate. By hand
    the synchronous step is least at 4 | 4, the pipelined one at 2 | 6 (training 2x longer, generation 1.5x
    shorter than at 4 | 4, and only the longer side counts)."""
    d = split_plan(1, overrides=[*SMALL, f"rollout.async_steps={async_steps}"])
    assert d.options[0].plan.model.params == PARAMS == 1_543_714_304
    fitting = {o.split.train.gpus: o for o in d.options if o.estimate is not None}
    assert sorted(fitting) == [1, 2, 4]
    hand = {k: hand_step(k, o.plan.refit.seconds) for k, o in fitting.items()}
    for k, o in fitting.items():
        got = o.estimate.step
        assert (got.generation, got.training, got.sync) == pytest.approx(
            (hand[k].generation, hand[k].training, hand[k].sync), rel=1e-12)
    objective = "pipelined" if async_steps else "synchronous"
    assert min(hand, key=lambda k: getattr(hand[k], objective)) == chosen
    c = d.chosen
    assert c.split.train.gpus == chosen and c.split.generate.gpus == 8 - chosen
    assert c.split.text == f"train node 0 GPUs 0-{chosen - 1} / generate node 0 GPUs {chosen}-7"
    assert c.split.same_node and c.estimate.sync.link == "NVLink"
    g = c.estimate.generation  # at 2 | 6: 6 engines of 4096 sequences, 330 at once in the KV pool
    assert (g.engines, g.sequences_per_engine) == (8 - chosen, 1536 * 16 // (8 - chosen))
    if chosen == 2:
        assert (g.concurrent, g.waves, g.bound) == (330, 13, "memory")


def test_the_ratio_is_the_hand_arithmetic():
    s = StepTimes(generation=30.0, training=10.0, sync=2.0)
    assert (s.synchronous, s.pipelined) == (42.0, 32.0)
    assert s.ratio == 32 / 42 and s.limit == 30 / 40
    est = split_plan(1, overrides=[*SMALL, "rollout.async_steps=1"]).chosen.estimate
    g, t, sync = est.generation.seconds, est.train.seconds, est.sync.seconds
    assert est.step.ratio == (max(g, t) + sync) / (g + t + sync) and est.step.limit == max(g, t) / (g + t)


def test_whole_nodes_when_there_are_two_or_more():
    splits = candidate_splits(P.Hardware(nodes=4, gpus_per_node=8))
    assert [(s.train.gpus, s.generate.gpus) for s in splits] == [(8, 24), (16, 16), (24, 8)]
    s = splits[1]
    assert s.text == "train nodes 0-1 (ranks 0-15) / generate nodes 2-3 (ranks 16-31)" and not s.same_node
    assert (s.generate.hardware.nodes, s.generate.hardware.gpus_per_node) == (2, 8)
    d = split_plan(4, mem=141.0, overrides=["rollout.colocate=false", "rollout.async_steps=1"])
    assert d.chosen.split.train.gpus == 16  # 24 | 8 is refused: DP=3 does not divide the mini-batch
    assert any("must divide by DP=3" in p for p in d.options[2].plan.problems)
    est = d.chosen.estimate
    assert est.sync.link == "IB" and est.sync.transfer_s == pytest.approx(2 * 32_763_876_352 / 50e9)
    assert est.generation.engines == 2 * 8 // 4  # SGLang TP=4 fills the two generation nodes


def test_refused_when_no_split_fits_every_reason_listed(capsys):
    d = split_plan(1, overrides=["rollout.colocate=false"])  # TP=8 divides no part of one 8-GPU node
    assert not d.fits and len(d.options) == 7 and all(not o.fits for o in d.options)
    for o in d.options:
        for p in o.plan.problems:
            assert f"{o.split.text}: {p}" in d.problems
    args = ["--config", str(CFG_32B), "--nodes", "2", "--gpus-per-node", "8", "rollout.colocate=false"]
    assert plan_main(args) == 1  # 8 GPUs cannot hold the 32B actor's optimizer at DP=1 on 80 GiB
    out = capsys.readouterr().out
    assert "verdict: REFUSED (no split fits)" in out
    assert "  - train node 0 (ranks 0-7) / generate node 1 (ranks 8-15): train phase needs" in out
    assert plan_main(args + ["--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["fits"] is False and data["disaggregated"]["chosen"] is None and "REFUSED" in captured.err
    assert data["problems"] and all(p.startswith("train node 0") for p in data["problems"])
    one = split_plan(1, gpus=1, overrides=["rollout.colocate=false"])
    assert not one.fits and "at least 2 GPUs" in one.problems[0]


def test_json_carries_the_report_numbers(capsys):
    args = ["--config", str(CFG_32B), "--nodes", "1", "--gpus-per-node", "8", "--prompt-len", str(P_LEN),
            "--response-len", str(R_LEN), *SMALL, "rollout.async_steps=1"]
    assert plan_main(args) == 0
    text = capsys.readouterr().out
    assert plan_main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    d = data["disaggregated"]
    assert data["fits"] is True and data["hardware"]["world_size"] == 2  # the training side's plan
    assert (d["objective"], d["async_steps"], d["cluster"]["world_size"]) == ("pipelined", 1, 8)
    assert (d["train"]["ranks"], d["generate"]["ranks"], d["generate"]["gpus"]) == ([0, 1], [2, 7], 6)
    assert d["splits"][d["chosen"]]["train"] == d["train"] and len(d["splits"]) == 7
    sec = d["seconds"]
    assert set(sec) == {"generation", "training", "sync", "synchronous", "pipelined", "ratio", "limit"}
    assert sec["pipelined"] == pytest.approx(max(sec["generation"], sec["training"]) + sec["sync"])
    assert sec["synchronous"] == pytest.approx(sec["generation"] + sec["training"] + sec["sync"])
    assert d["estimate"]["generation"]["seconds"] == sec["generation"] and d["assumptions"]
    for name in ("generation", "training", "synchronous", "pipelined"):
        printed = re.search(rf"^  {name} +([\d.]+) ", text, flags=re.M).group(1)
        assert printed == f"{sec[name]:.1f}"
    ratio = re.search(r"^  ratio +([\d.]+) +pipelined / synchronous \(limit max / sum = ([\d.]+)\)",
                      text, flags=re.M)
    assert ratio.groups() == (f"{sec['ratio']:.3f}", f"{sec['limit']:.3f}")
    assert "train     node 0 GPUs 0-1: 2 GPUs, actor TP=1 x PP=1 x DP=2" in text
    assert text.rstrip().endswith("verdict: FITS")


def test_synchronous_configs_show_the_pipelined_step_as_an_option(capsys):
    args = ["--config", str(CFG_32B), "--nodes", "1", "--gpus-per-node", "8", *SMALL]
    assert plan_main(args) == 0
    assert "max(generation, training) + weight sync with rollout.async_steps=1" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [(), ("rollout.colocate=false", "rollout.engine=embedded")])
def test_colocated_and_embedded_plans_are_unchanged(capsys, overrides):
    """Only SGLang servers on their own GPUs are split; everything else prints make_plan's plan as before."""
    args = ["--config", str(CFG_32B), "--nodes", "16", "--gpus-per-node", "8", *overrides]
    assert plan_main(args) == 0
    cfg = load_config(CFG_32B, list(overrides))
    spec, source = P.resolve_model(cfg)
    plan = P.make_plan(cfg, spec, P.Hardware(nodes=16, gpus_per_node=8), model_source=source,
                       config_name=str(CFG_32B))
    assert capsys.readouterr().out == format_plan(plan) + "\n"
    assert plan_main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "disaggregated" not in data and data == json.loads(json.dumps(plan.to_dict()))


def test_time_flags_are_checked(capsys):
    base = ["--config", str(CFG_32B), "--nodes", "2", "--gpus-per-node", "8", "rollout.colocate=false"]
    for bad in (["--mfu", "0"], ["--hbm-util", "1.5"], ["--peak-tflops", "-1"], ["--response-len", "0"],
                ["--gen-rounds", "0"]):
        assert plan_main(base + bad) == 2
        assert "--mfu and --hbm-util in (0, 1]" in capsys.readouterr().err
    assert plan_main(base + ["--response-len", "20481"]) == 2  # a mean above rollout.max_response_len
    assert "at most rollout.max_prompt_len=2048 / max_response_len=20480" in capsys.readouterr().err
    assert Throughput().flops == FLOPS

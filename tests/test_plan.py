"""The dry-run planner (megatron_dapo.plan): its arithmetic against hand-computed numbers for
Qwen2.5-32B, the fit / refuse verdicts, the CLI's exit codes, and the text report and JSON agreeing.
Fast: no torch.distributed, no GPU."""

import ast
import json
import re
from pathlib import Path

import pytest

from megatron_dapo import plan as P
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.plan.cli import main as plan_main

REPO = Path(__file__).resolve().parents[1]
CFG_32B = REPO / "examples/configs/dapo_qwen2.5_32b.yaml"
GIB = 2**30

# Qwen2.5-32B by hand (public config.json): h=5120, ffn=27648, 64 layers, 40 heads x 128, 8 KV heads,
# vocab 152064 (Megatron pads it to a multiple of 128*TP: 152576 at TP=8), untied embeddings.
H, FFN, L, KVD, V, V_PAD8 = 5120, 27648, 64, 8 * 128, 152064, 152576
LAYER_SHARDED = H * (H + 2 * KVD) + (H + 2 * KVD) + H * H + 3 * H * FFN  # QKV (+bias), out proj, SwiGLU
LAYER_REPL = 2 * H  # two RMSNorms
PARAMS_32B = L * (LAYER_SHARDED + LAYER_REPL) + 2 * V * H + H  # + embedding, lm head, final norm
PARAMS_PER_GPU_TP8 = L * (LAYER_SHARDED // 8 + LAYER_REPL) + 2 * (V_PAD8 * H // 8) + H


def plan_for(nodes, gpus=8, overrides=(), mem=80.0, **kw):
    cfg = load_config(CFG_32B, list(overrides))
    spec, source = P.resolve_model(cfg)
    hw = P.Hardware(nodes=nodes, gpus_per_node=gpus, gpu_mem_gib=mem)
    return P.make_plan(cfg, spec, hw, model_source=source, **kw)


@pytest.fixture(scope="module")
def plan16():
    return plan_for(16)


def test_parameter_counts_match_hand_computation(plan16):
    assert PARAMS_32B == 32_763_876_352  # = the 65.5 GB of bf16 safetensors of Qwen/Qwen2.5-32B
    assert plan16.model.params == PARAMS_32B
    assert PARAMS_PER_GPU_TP8 == 4_096_717_824
    assert plan16.train.worst.params == PARAMS_PER_GPU_TP8
    # ~ params / (TP x PP); the difference is the vocab padding and the TP-replicated norms
    assert PARAMS_PER_GPU_TP8 == pytest.approx(PARAMS_32B / 8, rel=1e-3)


def test_actor_memory_per_gpu_16x8(plan16):
    tr = plan16.train.worst
    assert (plan16.layout.tp, plan16.layout.pp, plan16.layout.dp) == (8, 1, 16)
    assert tr.weights == 2 * PARAMS_PER_GPU_TP8  # bf16
    assert tr.weights == pytest.approx(2 * PARAMS_32B / (8 * 1), rel=1e-3)
    assert tr.main_grads == 4 * PARAMS_PER_GPU_TP8  # fp32 grad buffer, full size
    assert tr.optimizer == 12 * PARAMS_PER_GPU_TP8 / 16  # master + Adam m, v sharded over DP=16
    # activations, full recompute, sequence parallel, T = 24576 tokens (micro_batch_tokens >= 2048+20480):
    t, a = 24576, 2
    kept_inputs = L * 1 * a * t * H / 8
    one_layer = a * t * ((2 * H + 2 * KVD + 3 * FFN) / 8 + 4 * H / 8)
    logits_and_grad = t * V_PAD8 / 8 * a * 2
    assert one_layer == 710_934_528
    assert tr.activations_train == pytest.approx(kept_inputs + 2 * one_layer + logits_and_grad)
    assert tr.activations == tr.activations_train  # the logprob pass (forward only) needs less
    assert tr.total == pytest.approx(tr.weights + tr.main_grads + tr.optimizer + tr.activations + 4 * GIB)
    assert 30 * GIB < tr.total < 40 * GIB
    phase = plan16.phase("train")  # the same numbers as the train phase's components, per side
    assert phase.name == "train" and phase.engine == {} and phase.reserve == 4 * GIB
    assert phase.actor == {"weights": tr.weights, "main_grads": tr.main_grads, "optimizer": tr.optimizer,
                           "activations": tr.activations}
    assert phase.total == tr.total


def test_rollout_kv_cache_16x8(plan16):
    sg = plan16.rollout.sglang
    assert sg.engines == 128 // 4 and sg.engines_per_node == 2  # num_servers=0: fill each node
    one = plan_for(16, overrides=["rollout.sglang.num_servers=1"]).rollout.sglang
    assert one.engines == 16 and one.engines_per_node == 1
    assert sg.kv_bytes_per_token_engine == 2 * L * 8 * 128 * 2 == 262_144
    assert sg.kv_bytes_per_token_gpu == 2 * L * (8 // 4) * 128 * 2 == 65_536
    assert sg.weights == 2 * PARAMS_32B / 4
    pool = 0.6 * 80 * GIB - 2 * PARAMS_32B / 4
    assert sg.kv_pool == pytest.approx(pool)
    assert sg.kv_pool_tokens_per_engine == int(pool // 65_536)
    assert sg.worst_case_sequences_in_flight == int(pool // 65_536) // (2048 + 20480)
    assert sg.sequences_per_round_per_engine == 3 * 512 * 16 // 32
    phase = plan16.phase("generate")
    assert plan16.rollout.actor.resident == 0 and phase.total == pytest.approx((0.6 * 80 + 4) * GIB)
    assert phase.actor == {}  # offloaded (actor.offload_when_idle)
    assert phase.engine == {"weights": sg.weights, "kv_cache": sg.kv_pool}
    resident = plan_for(16, overrides=["actor.offload_when_idle=false"])
    worst = plan16.train.worst
    assert resident.rollout.actor.resident == worst.weights + worst.main_grads + worst.optimizer
    assert resident.phase("generate").actor == {"weights": worst.weights, "main_grads": worst.main_grads,
                                                "optimizer": worst.optimizer}
    sync = plan16.phase("sync")  # the actor's weights next to the engine's, no KV cache yet
    assert sync.actor == {"weights": worst.weights,
                          "weight_sync_buckets": 2 * 2 * V * H}  # the embedding's bucket + its flat copy
    assert sync.engine == {"weights": sg.weights}


def test_tokens_and_updates_per_step(plan16):
    tok = plan16.tokens
    assert tok.trained_tokens_per_step_max == 512 * 16 * (2048 + 20480) == 184_549_376
    assert tok.trained_tokens_per_dp_rank_max == 184_549_376 // 16
    assert tok.generated_sequences_per_round == 1536 * 16
    assert tok.generated_tokens_per_round_max == 1536 * 16 * 20480
    assert tok.max_generation_rounds == 10
    assert tok.updates_per_step == 16  # mini-batch 32 prompts x 16 = 512 responses, as the paper
    assert plan_for(16, overrides=["train.mini_batch_size=512"]).tokens.updates_per_step == 1


def test_32b_fits_on_16_nodes_not_on_one(plan16):
    assert plan16.fits, plan16.problems
    one = plan_for(1)
    assert not one.fits
    assert any("train phase needs" in p and "optimizer" in p for p in one.problems), one.problems
    assert one.train.worst.optimizer == 12 * PARAMS_PER_GPU_TP8  # DP=1: nothing to shard
    assert plan_for(1, mem=141.0).fits  # one H200 node holds the actor


@pytest.mark.parametrize("overrides, nodes, reason", [
    (["parallel.pipeline_parallel=3"], 16, "does not divide world size"),
    (["parallel.pipeline_parallel=3"], 3, "num_hidden_layers=64 is not divisible by pipeline_parallel=3"),
    (["parallel.tensor_parallel=16"], 16, "num_attention_heads=40 is not divisible by tensor_parallel=16"),
    (["train.mini_batch_size=8"], 16, "must divide by DP=16"),
    (["rollout.sglang.tensor_parallel=3"], 3, "must divide gpus_per_node=8"),
    (["rollout.sglang.mem_fraction_static=0.15"], 16, "do not fit in mem_fraction_static"),
    (["rollout.sglang.num_servers=3"], 16, "num_servers=3 x tensor_parallel=4 needs 12 GPUs per node"),
    (["rollout.sglang.mem_fraction_static=0.2"], 16, "cannot hold one worst-case sequence"),
    (["actor.offload_when_idle=false"], 16, "generate phase needs"),
    (["actor.optimizer.distributed_optimizer=false"], 16, "train phase needs"),
])
def test_refusals_name_the_reason(overrides, nodes, reason):
    p = plan_for(nodes, overrides=overrides)
    assert not p.fits
    assert any(reason in msg for msg in p.problems), p.problems


def test_rollout_concurrency_check(plan16):
    fits = plan16.rollout.sglang.worst_case_sequences_in_flight
    assert plan_for(16, rollout_concurrency=fits).fits
    p = plan_for(16, rollout_concurrency=fits + 1)
    assert not p.fits and any("--rollout-concurrency" in m for m in p.problems)


def test_model_sources(tmp_path):
    cfg = load_config(CFG_32B, ["model.hf_dir=/nowhere/Qwen2.5-7B-Instruct"])
    spec, source = P.resolve_model(cfg)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (28, 3584, 28) and "built-in" in source
    p = P.make_plan(cfg, spec, P.Hardware(nodes=16, gpus_per_node=8))  # TP=8 does not split 28 heads
    assert any("num_attention_heads=28" in m for m in p.problems)
    (tmp_path / "config.json").write_text(json.dumps(P.KNOWN_MODELS["Qwen2.5-1.5B"]))
    spec, source = P.resolve_model(load_config(CFG_32B, [f"model.hf_dir={tmp_path}"]))
    assert spec.tied_embeddings and source == str(tmp_path / "config.json")
    spec, _ = P.resolve_model(cfg, model_config=tmp_path)  # --model-config wins
    assert spec.hidden_size == 1536
    with pytest.raises(P.PlanInputError, match="--model-config"):
        P.resolve_model(load_config(CFG_32B, ["model.hf_dir=/nowhere/MyModel"]))


def test_cli_exit_codes_and_json(capsys, tmp_path):
    base = ["--config", str(CFG_32B), "--gpus-per-node", "8"]
    assert plan_main(base + ["--nodes", "16"]) == 0
    out = capsys.readouterr().out
    assert "TP=8 x PP=1 x DP=16" in out and "verdict: FITS" in out and "32 engines x TP=4" in out
    assert plan_main(base + ["--nodes", "1", "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["fits"] is False and data["layout"]["dp"] == 1 and "REFUSED" in captured.err
    assert plan_main(base + ["--nodes", "16", "algo.eps_hgh=0.3"]) == 2  # config error
    assert "eps_high" in capsys.readouterr().err
    assert plan_main(base + ["--nodes", "16", "model.hf_dir=/nowhere/MyModel"]) == 2
    assert plan_main(base + ["--nodes", "0"]) == 2


@pytest.mark.parametrize("overrides", [(), ("actor.offload_when_idle=false",),
                                       ("parallel.pipeline_parallel=4",), ("rollout.colocate=false",)])
def test_report_and_json_agree_on_phase_totals(capsys, overrides):
    args = ["--config", str(CFG_32B), "--nodes", "16", "--gpus-per-node", "8", *overrides]
    plan_main(args)
    text = capsys.readouterr().out
    plan_main(args + ["--json"])
    data = json.loads(capsys.readouterr().out)
    printed = [float(x) for x in re.findall(r"^  total +([\d.]+) +of ", text, flags=re.M)]
    phases = data["phases"]
    assert list(phases) == ["generate", "train", "sync"]  # the phase model's phases, in its order
    assert printed == [round(p["total"] / GIB, 2) for p in phases.values()]
    for p in phases.values():  # a phase total is the sum of its components, per side, plus the reserve
        sides = sum(p["actor"].values()) + sum(p["engine"].values())
        assert p["total"] == pytest.approx(sides + p["reserve"])
    assert phases["train"]["total"] == data["memory"]["train_phase"]["total"]
    assert data["memory"]["train_phase"]["total"] == max(s["total"] for s in data["memory"]["stages"])
    engine = phases["generate"]["engine"]
    assert engine == ({} if "rollout.colocate=false" in overrides else
                      {"weights": data["memory"]["rollout_phase"]["weights"],
                       "kv_cache": data["memory"]["rollout_phase"]["kv_pool"]})


@pytest.mark.parametrize("fraction", ["0", "1", "1.5", "-0.1"])
def test_mem_fraction_static_is_a_config_check(capsys, fraction):
    override = f"rollout.sglang.mem_fraction_static={fraction}"
    with pytest.raises(ConfigError, match=r"mem_fraction_static=.* must be in \(0, 1\)"):
        load_config(CFG_32B, [override])
    assert plan_main(["--config", str(CFG_32B), "--nodes", "16", "--gpus-per-node", "8", override]) == 2
    assert "must be in (0, 1)" in capsys.readouterr().err
    cfg = load_config(CFG_32B)  # a config changed after loading: make_plan reports it through validate()
    cfg.rollout.sglang.mem_fraction_static = float(fraction)
    p = P.make_plan(cfg, P.resolve_model(cfg)[0], P.Hardware(nodes=16, gpus_per_node=8))
    assert not p.fits and any("mem_fraction_static" in m and "(0, 1)" in m for m in p.problems), p.problems


def test_plan_package_imports_form_layers():
    """core, memory and models import no other planner module; report reads core only; no cycle."""
    pkg = REPO / "megatron_dapo/plan"
    deps = {}
    for f in pkg.glob("*.py"):
        tree = ast.parse(f.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        deps[f.stem] = {m.rsplit(".", 1)[1] for m in mods if m.startswith("megatron_dapo.plan.")}
    assert deps["core"] == deps["memory"] == deps["models"] == set()
    assert deps["report"] == {"core"} and deps["build"] == {"core", "memory", "refit"}
    assert deps["refit"] == {"core", "memory"}
    done: set[str] = set()
    while len(done) < len(deps):  # peel modules whose imports are all peeled: fails on a cycle
        ready = {m for m, d in deps.items() if m not in done and d <= done}
        assert ready, f"import cycle among {set(deps) - done}"
        done |= ready


# ------------------------------------------------------------------------------------------ refit


def test_refit_at_32b_from_bytes_and_links(plan16):
    """Node-local refit at TP=8, PP=1 (a replica per node): every GPU all-gathers 7/8 of the model over
    NVLink, nothing crosses nodes; by hand from the nominal links and the assumed per-bucket overhead."""
    r = plan16.refit
    s = 2 * PARAMS_32B
    assert r.model_bytes == s and r.bucket_bytes == 512 * 2**20 and r.buckets == -(-s // (512 * 2**20))
    assert r.largest_bucket_bytes == 2 * V * H  # the embedding travels alone
    assert (r.tp_link, r.pp_link, r.cross_node_bytes_per_node) == ("NVLink", "-", 0.0)
    assert r.gather_s == pytest.approx(7 / 8 * s / 450e9)
    assert r.copy_s == pytest.approx(2 * s / 3350e9) and r.overhead_s == pytest.approx(r.buckets * 0.010)
    assert r.seconds == pytest.approx(r.gather_s + r.copy_s + r.overhead_s)


def test_refit_of_a_replica_that_spans_nodes_crosses_them():
    """PP=2 on 16 nodes: Megatron places the stages world/PP ranks apart, on different nodes, so each GPU
    receives the other stage (half the model) over its InfiniBand NIC."""
    r = plan_for(16, overrides=["parallel.pipeline_parallel=2", "train.mini_batch_size=64"]).refit
    s = 2 * PARAMS_32B
    assert (r.tp_link, r.pp_link) == ("NVLink", "IB")
    assert r.pp_receive_bytes == s / 2 and r.cross_node_bytes_per_node == 8 * s / 2
    assert r.gather_s == pytest.approx((7 / 8 * s / 2) / 450e9 + (s / 2) / 50e9)


def test_refit_is_printed_next_to_the_published_figure(capsys):
    assert plan_main(["--config", str(CFG_32B), "--nodes", "16", "--gpus-per-node", "8", "--ib-gbs", "25"]) \
        == 0
    out = capsys.readouterr().out
    assert re.search(r"refit .*\n  bytes +65\.5 GB in 123 buckets", out)
    assert "NeMo-RL (published): Qwen3-30B-A3B BF16, NCCL reshard refit 0.74-1.0 s" in out


@pytest.mark.parametrize("transport, copies, held", [("tensor", 2, "a bucket and its flat copy"),
                                                     ("disk", 1, "one bucket")])
def test_a_bucket_the_sync_phase_cannot_hold_is_refused(transport, copies, held):
    """The sync phase holds the largest bucket's gathered tensors (and, but for disk, its flat copy) beside
    the actor's and the engine's weights (7.6 + 15.3 GiB of a 72 GiB budget, by hand): 32 GiB of buckets fit,
    48 GiB do not, naming rollout.weight_sync_bucket_mb."""
    sync = f"rollout.sglang.weight_sync={transport}"
    ok = plan_for(16, overrides=[sync, f"rollout.weight_sync_bucket_mb={32768 // copies}"])
    assert ok.fits and ok.phase("sync").actor["weight_sync_buckets"] == 32 * GIB
    big = 49152 // copies
    p = plan_for(16, overrides=[sync, f"rollout.weight_sync_bucket_mb={big}"])
    assert not p.fits and any("sync phase needs" in m and f"{held} of rollout.weight_sync_bucket_mb={big}" in m
                              for m in p.problems), p.problems


def test_servers_on_their_own_gpus_must_hold_a_received_bucket():
    base = ["rollout.colocate=false", "rollout.sglang.weight_sync=distributed"]
    assert plan_for(16, overrides=base).fits
    p = plan_for(16, overrides=[*base, "rollout.weight_sync_bucket_mb=32768"])  # > 0.4 x 80 - 4 GiB
    assert any("does not fit beside the servers' static pool" in m for m in p.problems), p.problems


def test_refit_of_a_moe_model_counts_the_experts_broadcast_from_their_owner():
    """Qwen3-30B-A3B at EP=8 on one node: each GPU receives the 7/8 of the routed experts it does not hold,
    from their expert-parallel owners, over NVLink; nothing crosses a node."""
    from megatron_dapo.plan.memory import expert_params

    over = ["model.hf_dir=/m/Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
            "parallel.expert_parallel=8", "rollout.sglang.tensor_parallel=1"]
    p = plan_for(1, overrides=over, mem=141.0)
    spec = P.resolve_model(load_config(CFG_32B, over))[0]
    experts = 2 * spec.num_layers * expert_params(spec)
    r = p.refit
    assert (r.ep_link, r.tp_gather_bytes, r.cross_node_bytes_per_node) == ("NVLink", 0.0, 0.0)
    assert r.ep_receive_bytes == 7 / 8 * experts and r.gather_s == pytest.approx(7 / 8 * experts / 450e9)


def test_r3_counts_the_rollouts_routes_by_hand():
    """Qwen3-30B-A3B (48 layers, top-8 of 128 experts: a uint8 each) with r3: every trained token carries 48 x 8
    bytes of routes, scattered with its row and held on its DP rank; other replay modes carry none."""
    over = ["model.hf_dir=/m/Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
            "parallel.expert_parallel=8", "rollout.sglang.tensor_parallel=1"]
    p = plan_for(1, overrides=[*over, "actor.routing_replay=r3"], mem=141.0)
    tok = p.tokens
    assert tok.route_bytes_per_step_max == tok.trained_tokens_per_step_max * 48 * 8
    assert tok.route_bytes_per_dp_rank_max == tok.trained_tokens_per_dp_rank_max * 48 * 8
    from megatron_dapo.plan.report import format_plan

    assert "r3: the rollout's routes of the trained tokens" in format_plan(p)
    assert tok.route_bytes_held_max == tok.route_bytes_per_step_max  # synchronous: this step's batch alone
    piped = plan_for(1, overrides=[*over, "actor.routing_replay=r3", "rollout.async_steps=2", "rollout.colocate=false"],
                     mem=141.0).tokens
    assert piped.route_bytes_held_max == 3 * piped.route_bytes_per_step_max > 0
    assert plan_for(1, overrides=over, mem=141.0).tokens.route_bytes_per_step_max == 0

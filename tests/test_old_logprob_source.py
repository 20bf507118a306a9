"""algo.old_logprob_source=auto: the rule, condition by condition, with its reason; and a
tiny run where auto skips the pi_old pass against one that recomputes it: the rollout's logprobs are the
recomputed pi_old up to float rounding, and the update is the same to that rounding."""

import math

import pytest
import torch
from support import run_train, train_cmd

from megatron_dapo.config import AlgoConfig, Config, RolloutConfig
from megatron_dapo.loop.old_policy import resolve_old_logprob_source
from megatron_dapo.metrics import read_scalars

EXACT = dict(engine_on_actor_weights=True, dtype=torch.float32)


def resolve(algo=None, rollout=None, **kw):
    cfg = Config(algo=algo or AlgoConfig(old_logprob_source="auto"), rollout=rollout or RolloutConfig())
    return resolve_old_logprob_source(cfg.algo, cfg.rollout, cfg.rollout_correction(), **{**EXACT, **kw})


def test_auto_skips_only_on_the_actors_own_float32_weights():
    got = resolve()
    assert got.source == "rollout" and "actor's own float32 weights" in got.reason
    assert got.line().startswith("the rollout's logprobs, no recompute pass (algo.old_logprob_source=auto: ")


@pytest.mark.parametrize("algo, rollout, kw, why", [
    (AlgoConfig(old_logprob_source="auto", rollout_correction="token_tis"), None, {},
     "algo.rollout_correction=token_tis weighs pi_old against the rollout's logprobs"),
    (None, RolloutConfig(partial_rollout=True), {}, "rollout.partial_rollout"),
    (None, RolloutConfig(async_steps=1, colocate=False), {},
     "algo.rollout_correction=token_tis"),  # pipelined: auto's correction is on
    (None, RolloutConfig(engine="sglang"), {}, "rollout.engine=sglang computes with its own kernels"),
    (None, None, {"dtype": torch.bfloat16}, "model dtype bfloat16"),
    (None, None, {"engine_on_actor_weights": False}, "the embedded engine holds its own copy of the weights"),
])
def test_each_condition_makes_auto_recompute(algo, rollout, kw, why):
    got = resolve(algo, rollout, **kw)
    assert got.source == "recompute" and got.reason.startswith("algo.old_logprob_source=auto: ")
    assert why in got.reason, got.reason
    assert got.line().startswith("recomputed by the actor (")


def test_every_failed_condition_is_named():
    got = resolve(AlgoConfig(old_logprob_source="auto", rollout_correction="seq_mis"),
                  RolloutConfig(partial_rollout=True, streaming=True), engine_on_actor_weights=False)
    assert got.source == "recompute"
    assert "rollout_correction=seq_mis" in got.reason and "partial_rollout" in got.reason
    assert "own copy" in got.reason


def test_explicit_sources_mean_what_they_say():
    for kw in ({}, {"engine_on_actor_weights": False, "dtype": torch.bfloat16}):
        assert resolve(AlgoConfig(old_logprob_source="recompute"), **kw).source == "recompute"
        assert resolve(AlgoConfig(old_logprob_source="rollout"), RolloutConfig(engine="sglang"), **kw).source \
            == "rollout"
    assert AlgoConfig().old_logprob_source == "recompute"  # equal to rounding only: not the default


@pytest.mark.slow
def test_where_auto_skips_it_equals_the_recompute(base_dir, tmp_path, python_env):
    """Same seed, same shared-weight engine: step 1 samples the same batch in both runs. The recompute run's
    monitored |pi_old - pi_rollout| is exactly the gap auto leaves in the ratio; the update follows it."""
    common = ["train.steps=2", "checkpoint.save_every=0", "eval.every_steps=0", "checkpoint.export_hf=false",
              "actor.offload_when_idle=false"]
    logs = {}
    for source in ("recompute", "auto"):
        r = run_train(train_cmd(base_dir, tmp_path, source, *common, f"algo.old_logprob_source={source}"),
                      python_env)
        logs[source] = r.stderr
    assert "pi_old: recomputed by the actor (algo.old_logprob_source=recompute)" in logs["recompute"]
    assert "pi_old: the rollout's logprobs, no recompute pass (algo.old_logprob_source=auto: the embedded " \
           "engine samples from the actor's own float32 weights" in logs["auto"]
    ref, auto = read_scalars(tmp_path / "tb" / "recompute"), read_scalars(tmp_path / "tb" / "auto")
    gap = ref["rollout/train_rollout_logprob_absdiff"]
    assert set(gap) == {1, 2} and max(gap.values()) < 1e-5, gap  # also after an update and its sync
    assert auto["rollout/train_rollout_logprob_absdiff"][1] == 0.0  # pi_old is the rollout's
    for tag in ("train/reward_mean", "response_length/mean", "actor/mean_token_prob"):
        assert auto[tag][1] == ref[tag][1], tag  # the same batch
    for tag in ("actor/pg_loss", "actor/grad_norm", "actor/approx_kl"):
        assert math.isclose(auto[tag][1], ref[tag][1], rel_tol=1e-5, abs_tol=1e-7), (tag, auto[tag][1], ref[tag][1])
    assert auto["actor/clipfrac_low"][1] == ref["actor/clipfrac_low"][1]
    assert max(auto["timing/old_logprob_s"].values()) < 0.05  # the pass is skipped

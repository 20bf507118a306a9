import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dapo.algo.policy_losses import clip_range, policy_loss_spec
from megatron_dapo.config import (
    Config,
    ConfigError,
    apply_delta,
    load_config,
    parse_override,
    to_yaml,
    validate,
)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_defaults_are_valid_and_dapo():
    cfg = Config()
    validate(cfg, world_size=1)
    assert cfg.algo.policy_loss == "dapo"
    # unset: the loss's own clip range, DAPO's 0.2 / 0.28
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (None, None)
    assert clip_range(policy_loss_spec("dapo"), cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.algo.loss_agg_mode == "token-mean"
    assert not hasattr(cfg.algo, "kl_coef")  # DAPO removes the KL term: no setting pretends otherwise
    assert cfg.algo.dynamic_sampling


def test_defaults_follow_the_paper_to_the_letter():
    a, r = Config().algo, Config().reward
    assert a.filter_metric == "acc"  # eq. 11: 0 < #correct < G
    assert a.clip_ratio_c is None  # eq. 10, no dual-clip
    assert r.answer_fallback == "none"  # only the Answer: line counts
    assert (Config().rollout_correction(), a.old_logprob_source) == ("none", "recompute")
    assert (a.rollout_correction_threshold, a.rollout_correction_threshold_low) == (2.0, None)


def test_rollout_streams_by_default_and_the_study_pins_the_rounds():
    r = Config().rollout
    assert r.streaming and not r.partial_rollout  # on since it won the benchmark; partial opt-in
    study = load_config(next(p for p in CONFIGS if p.name == "study_dapo_small.yaml"))
    assert not study.rollout.streaming  # the DAPO study runs the paper's Algorithm 1


def test_dapo14_options_parse():
    cfg = load_config(None, ["algo.clip_ratio_c=10", "algo.filter_metric=score",
                             "reward.answer_fallback=boxed", "algo.rollout_correction=seq_mis",
                             "algo.rollout_correction_threshold=3",
                             "algo.rollout_correction_threshold_low=0.5"])
    assert cfg.algo.clip_ratio_c == 10.0 and isinstance(cfg.algo.clip_ratio_c, float)
    assert (cfg.algo.filter_metric, cfg.reward.answer_fallback) == ("score", "boxed")
    assert (cfg.algo.rollout_correction_threshold, cfg.algo.rollout_correction_threshold_low) == (3.0, 0.5)
    assert load_config(None, ["algo.clip_ratio_c=null"]).algo.clip_ratio_c is None
    cfg = load_config(None, ["algo.old_logprob_source=rollout", "algo.rollout_correction_threshold=0.5"])
    assert cfg.algo.old_logprob_source == "rollout"  # a tis bound below 1 is odd but well defined


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_example_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"dapo_qwen2.5_32b.yaml", "tiny_cpu.yaml"} <= names


def test_32b_config_holds_the_papers_hyperparameters():
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples/configs/dapo_qwen2.5_32b.yaml")
    assert cfg.algo.group_size == 16
    assert cfg.train.prompt_batch_size == 512 and cfg.train.mini_batch_size * cfg.algo.group_size == 512
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.actor.optimizer.warmup_steps == 20
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.rollout.max_response_len == 20480 and cfg.reward.overlong_cache_len == 4096
    assert cfg.eval.top_p == 0.7 and cfg.eval.n_samples == 32 and cfg.eval.temperature == 1.0
    # 512 prompts x 16 responses per step, mini-batches of 512 prompts: updates per step
    updates = cfg.train.prompt_batch_size // cfg.train.mini_batch_size * cfg.algo.epochs_per_rollout
    assert updates == 16 and cfg.train.prompt_batch_size * cfg.algo.group_size == 8192
    validate(cfg, world_size=128)


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["algo.eps_high=0.3", "actor.optimizer.lr=1e-5", "logging.run_name=123",
                             "data.val_path=null", "algo.dynamic_sampling=false", "train.steps=7"])
    assert cfg.algo.eps_high == 0.3
    assert cfg.actor.optimizer.lr == 1e-5 and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.logging.run_name == "123"
    assert cfg.data.val_path is None
    assert cfg.algo.dynamic_sampling is False
    assert cfg.train.steps == 7


def test_int_widens_to_float_but_not_reverse():
    cfg = Config()
    apply_delta(cfg, {"algo": {"eps_high": 1}})
    assert cfg.algo.eps_high == 1.0 and isinstance(cfg.algo.eps_high, float)
    with pytest.raises(ConfigError, match="train.steps"):
        apply_delta(cfg, {"train": {"steps": 1.5}})
    with pytest.raises(ConfigError, match="train.steps"):
        apply_delta(cfg, {"train": {"steps": True}})


@pytest.mark.parametrize("override, key", [
    ("algo.eps_hgh=0.3", "algo.eps_hgh"),
    ("actor.optimiser.lr=1", "actor.optimiser"),
    ("nope.x=1", "nope"),
])
def test_unknown_key_is_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_suggests_the_near_one():
    with pytest.raises(ConfigError, match="did you mean 'algo.eps_high'"):
        load_config(None, ["algo.eps_hgh=0.3"])


@pytest.mark.parametrize("override, key", [
    ("train.steps=abc", "train.steps"),
    ("algo.loss_agg_mode=token-sum", "algo.loss_agg_mode"),
    ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling"),
    ("algo.filter_metric=reward", "algo.filter_metric"),
    ("reward.answer_fallback=hashes", "reward.answer_fallback"),
    ("algo.rollout_correction=tis", "algo.rollout_correction"),
    ("algo.old_logprob_source=engine", "algo.old_logprob_source"),
    ("algo.clip_ratio_c=off", "algo.clip_ratio_c"),
    ("algo=3", "algo"),
])
def test_wrong_type_is_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_yaml_wrong_type_and_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  group_size: sixteen\n")
    with pytest.raises(ConfigError, match="algo.group_size"):
        load_config(bad)
    bad.write_text("rollout:\n  sglang:\n    prot: 1\n")
    with pytest.raises(ConfigError, match="rollout.sglang.prot"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_scientific_notation_is_a_float(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  optimizer:\n    lr: 1e-6\n")  # YAML 1.1 reads this as a string
    assert load_config(f).actor.optimizer.lr == 1e-6


@pytest.mark.parametrize("overrides, fragment", [
    (["train.prompt_batch_size=10", "train.mini_batch_size=4"], "must divide"),
    (["reward.overlong_cache_len=20480"], "overlong_cache_len"),
    (["algo.group_size=1"], "group_size"),
    (["algo.eps_low=1.0"], "eps_low"),
    (["algo.kl_coef=0.01"], "unknown config key 'algo.kl_coef'"),
    (["eval.top_p=0"], "eval.top_p"),
    (["parallel.sequence_parallel=true"], "sequence_parallel"),
    (["actor.optimizer.lr=0"], "optimizer.lr"),
    (["checkpoint.resume=never"], "must be auto, none or an existing checkpoint folder"),
    (["algo.clip_ratio_c=1.0"], r"algo.clip_ratio_c=1.0 must be > 1"),
    (["algo.clip_ratio_c=0.5"], r"algo.clip_ratio_c=0.5 must be > 1"),
    (["algo.rollout_correction_threshold=0"], r"rollout_correction_threshold=0.0 must be > 0"),
    (["algo.rollout_correction_threshold_low=2.0"], r"threshold_low=2.0 must be in \(0, "),
    (["algo.rollout_correction_threshold_low=0"], r"threshold_low=0.0 must be in \(0, "),
    (["algo.rollout_correction=token_mis", "algo.rollout_correction_threshold=1"],
     "must be > 1 for token_mis"),
    (["algo.rollout_correction=token_tis", "algo.old_logprob_source=rollout"],
     "every correction weight would be 1"),
    (["rollout.engine=sglang", "rollout.sglang.weight_sync=distributed"],
     r"weight_sync=distributed with rollout.colocate=true .*Duplicate GPU.*: use weight_sync=tensor"),
])
def test_cross_field_validation(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_distributed_weight_sync_is_fine_for_servers_on_their_own_gpus():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.weight_sync=distributed",
                             "rollout.colocate=false"])
    assert cfg.rollout.sglang.weight_sync == "distributed"


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.group_size=1", "algo.eps_low=2.0"])
    assert "group_size" in str(e.value) and "eps_low" in str(e.value)


def test_parallel_layout_against_world_size():
    cfg = load_config(None, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                             "train.prompt_batch_size=6", "train.mini_batch_size=3"])
    validate(cfg, world_size=4)  # DP = 1
    with pytest.raises(ConfigError, match="does not divide world size 6"):
        validate(cfg, world_size=6)
    with pytest.raises(ConfigError, match="DP=2"):
        validate(cfg, world_size=8)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 4"):  # one process: how to start four
        validate(cfg, world_size=1)


@pytest.mark.parametrize("override, suggested", [
    ("steps=3", "train.steps"), ("rollout.steps=3", "train.steps"), ("train.stepz=3", "train.steps")])
def test_an_unknown_key_suggests_where_it_lives(override, suggested):
    with pytest.raises(ConfigError, match=f"did you mean '{suggested}'"):
        load_config(None, [override])


def test_soft_punishment_off_skips_its_check():
    cfg = load_config(None, ["reward.soft_overlong_punishment=false", "reward.overlong_cache_len=99999"])
    assert cfg.reward.overlong_cache_len == 99999


def test_printed_yaml_round_trips():
    cfg = load_config(None, ["algo.eps_high=0.31", "data.val_path=/x.parquet"])
    again = Config()
    apply_delta(again, yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


def test_parse_override_nests():
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": "1"}}}
    with pytest.raises(ConfigError):
        parse_override("novalue")


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "megatron_dapo.config", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_cli_print(python_env, repo_root):
    r = _cli("--config", str(repo_root / "examples/configs/tiny_cpu.yaml"), "algo.eps_high=0.3",
             "--print", env=python_env)
    assert r.returncode == 0, r.stderr
    tree = yaml.safe_load(r.stdout)
    assert tree["algo"]["eps_high"] == 0.3 and tree["algo"]["group_size"] == 8


def test_cli_error_exit_code(python_env):
    r = _cli("algo.eps_hgh=0.3", env=python_env)
    assert r.returncode == 2 and "algo.eps_hgh" in r.stderr and "Traceback" not in r.stderr


def test_validation_needs_no_heavy_import(python_env, repo_root):
    code = ("import sys; from megatron_dapo.config import load_config;"
            f"load_config({str(repo_root / 'examples/configs/dapo_qwen2.5_32b.yaml')!r});"
            "heavy = [m for m in ('torch', 'megatron', 'transformers', 'sglang') if m in sys.modules];"
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", ["dapo", "gspo", "cispo", "dr_grpo", "my.losses:fancy"])
def test_policy_losses_parse(kind):
    assert load_config(None, [f"algo.policy_loss={kind}"]).algo.policy_loss == kind


@pytest.mark.parametrize("overrides, fragment", [
    (["algo.policy_loss=ppo"], "algo.policy_loss='ppo' must be one of dapo, gspo, cispo, dr_grpo or module"),
    (["algo.policy_loss=cispo", "algo.eps_low=0.2"], "has no lower bound"),
    (["algo.policy_loss=cispo", "algo.eps_high=0.28"], "caps the weight min(r, eps_high) itself"),
    (["algo.policy_loss=cispo", "algo.clip_ratio_c=3"], "cispo has no dual clip"),
    (["algo.policy_loss=dr_grpo", "algo.loss_agg_mode=seq-mean-token-mean"], "does not apply to"),
])
def test_policy_loss_settings_are_checked(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert fragment in str(e.value)


def test_each_loss_takes_what_it_uses():
    cfg = load_config(None, ["algo.policy_loss=cispo", "algo.eps_high=4"])
    assert clip_range(policy_loss_spec("cispo"), cfg.algo.eps_low, cfg.algo.eps_high) == (0.0, 4.0)
    cfg = load_config(None, ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean",
                             "algo.clip_ratio_c=3"])
    assert clip_range(policy_loss_spec("gspo"), cfg.algo.eps_low, cfg.algo.eps_high) == (3e-4, 4e-4)
    cfg = load_config(None, ["algo.policy_loss=dr_grpo", "algo.eps_low=0.1"])
    assert clip_range(policy_loss_spec("dr_grpo"), cfg.algo.eps_low, cfg.algo.eps_high) == (0.1, 0.2)


def test_the_prompt_template_names_are_the_templates_the_data_layer_holds():
    from megatron_dapo.config.schema import PROMPT_TEMPLATES
    from megatron_dapo.data.templates import BUILTIN_TEMPLATES

    assert PROMPT_TEMPLATES == ("auto", *BUILTIN_TEMPLATES)


def test_a_resumed_run_may_change_only_what_the_fields_say():
    from megatron_dapo.config.ranges import may_change_on_resume

    cfg = Config()
    for key in ("train.steps", "model.load", "checkpoint.dir", "checkpoint.save_every", "logging.run_name",
                "logging.wandb.project", "rollout.sglang.base_port"):
        assert may_change_on_resume(cfg, key), key
    for key in ("train.seed", "algo.eps_high", "rollout.max_response_len", "logging.samples_every", "nope.x"):
        assert not may_change_on_resume(cfg, key), key


def test_the_pace_after_the_first_step_is_hand_arithmetic():
    from megatron_dapo.loop.report import pace_line

    first = {"timing/rollout_s": 3.0, "timing/update_s": 6.0, "timing/reward_s": 0.01, "timing/step_s": 10.0,
             "timing/eval_s": 30.0, "train/acc_mean": 0.5}
    line = pace_line(first, steps_left=49, evals_left=5)
    assert line == ("the first step took 10.0 s (update 6.0, rollout 3.0); the 49 step(s) left + 5 evaluation(s) "
                    "of 30 s: about 11 min at this pace")  # 49 x 10 + 5 x 30 = 640 s
    assert pace_line({"timing/step_s": 2.0, "timing/eval_s": 0.3}, 3, 1).endswith(
        "the 3 step(s) left + 1 evaluation(s) of 0.3 s: about 6.3 s at this pace")

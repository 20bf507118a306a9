"""Every numeric config field has a range; YAML and override mistakes are one line.

The walk over the dataclasses is the independent reference: a numeric field without a declared range,
or one that takes NaN / inf / a nonsensical negative value, fails here.
"""

import dataclasses
import math
import subprocess
import sys
import typing

import pytest

from megatron_dapo.config import Config, ConfigError, load_config, validate


def numeric_leaves(obj=None, prefix=""):
    """dotted key -> (type annotation, default) for every int/float (optional or not) field."""
    obj = Config() if obj is None else obj
    out = {}
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            out.update(numeric_leaves(value, f"{prefix}{f.name}."))
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if any(a in (int, float) for a in args) and tp is not bool:
            out[f"{prefix}{f.name}"] = (float if float in args else int, value)
    return out


# fields where a negative value is meaningful (an entropy *penalty*)
NEGATIVE_OK = {"algo.entropy_coef"}


def set_key(cfg, key, value):
    *path, name = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, name, value)


def rejected(key, value) -> str | None:
    cfg = Config()
    set_key(cfg, key, value)
    try:
        validate(cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_the_tree_has_numeric_fields_to_walk():
    leaves = numeric_leaves()
    assert len(leaves) > 40 and "actor.optimizer.adam_beta2" in leaves and "rollout.sglang.base_port" in leaves


@pytest.mark.parametrize("key", sorted(numeric_leaves()))
def test_every_numeric_field_rejects_nan_inf_and_nonsense_negatives(key):
    kind, _ = numeric_leaves()[key]
    if kind is float:
        for bad in (math.nan, math.inf, -math.inf):
            msg = rejected(key, bad)
            assert msg is not None and key in msg, (key, bad)
    if key not in NEGATIVE_OK:
        msg = rejected(key, kind(-1))
        assert msg is not None and key in msg, (key, -1)


@pytest.mark.parametrize("override", [
    "actor.optimizer.lr=.inf", "algo.eps_high=.nan", "train.steps=-5", "checkpoint.save_every=-1",
    "reward.overlong_penalty_factor=-1", "actor.optimizer.adam_beta2=2", "algo.gen_batch_multiplier=.inf",
    "actor.optimizer.weight_decay=.nan", "rollout.sglang.base_port=70000", "logging.length_blowup_frac=1.5",
    "actor.optimizer.lr=1e30", "actor.optimizer.lr=1e6",  # once accepted: the first update exploded
])
def test_the_issues_out_of_range_values_are_named(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_defaults_and_examples_stay_valid(repo_root):
    validate(Config())
    for path in sorted((repo_root / "examples" / "configs").glob("*.yaml")):
        load_config(path)


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  eps_high: 0.3\n  group_size: [4\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert str(bad) in msg and "line 3" in msg and "\n" not in msg, msg


def test_duplicate_yaml_keys_are_errors(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("algo:\n  eps_high: 0.3\n  eps_high: 0.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(dup)
    assert "eps_high" in str(e.value) and str(dup) in str(e.value) and "line 3" in str(e.value)
    top = tmp_path / "top.yaml"
    top.write_text("algo:\n  eps_high: 0.3\ntrain:\n  steps: 2\nalgo:\n  eps_low: 0.1\n")
    with pytest.raises(ConfigError, match="duplicate key 'algo'"):
        load_config(top)


@pytest.mark.parametrize("override", ["train.steps=[1", "algo.eps_high={0.3", "train.seed='1"])
def test_malformed_override_is_one_line(override):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert override.split("=")[0] in str(e.value) and "\n" not in str(e.value)


def test_a_string_field_keeps_text_that_is_not_yaml():
    assert load_config(None, ["logging.run_name=[x"]).logging.run_name == "[x"


@pytest.mark.parametrize("args, needle", [
    (["train.steps=[1"], "train.steps"),
    (["actor.optimizer.lr=.inf"], "actor.optimizer.lr"),
])
def test_config_cli_reports_one_line(python_env, args, needle):
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.config", *args], capture_output=True, text=True,
                       env=python_env, timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_yaml_error_in_the_trainer_cli_is_one_line(python_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\n")
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.config", "--config", str(bad)], capture_output=True,
                       text=True, env=python_env, timeout=60)
    assert r.returncode == 2 and str(bad) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

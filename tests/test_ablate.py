"""The ablation study (megatron_dapo.study, tools/ablate.py): Table 1's cumulative rows and the
contrasts as resolved configs, the report's arithmetic by hand, and a 2-step smoke of the dapo-small
study through the command line (resumable: a stored run is not run again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_dapo.config import load_config, to_dict
from megatron_dapo.study import STUDIES, Contrast, Study, Variant, report, table1_variants
from megatron_dapo.study.curves import first_reaching
from megatron_dapo.study.runner import config_path, inputs_digest, load_done, plan, result_path

REPO = Path(__file__).resolve().parents[1]
SWITCHES = ("algo.eps_high", "algo.loss_agg_mode", "algo.overlong_filtering", "reward.soft_overlong_punishment",
            "algo.dynamic_sampling")


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _resolved(study: Study, variant: Variant) -> dict:
    return _flat(to_dict(load_config(str(config_path(study)), [*study.overrides, *variant.overrides])))


def _switches(cfg: dict) -> tuple:
    return tuple(cfg[k] for k in SWITCHES)


def test_table1_rows_are_cumulative_and_end_at_dapo():
    study = STUDIES["dapo-small"]()
    rows = [_switches(_resolved(study, v)) for v in table1_variants()]
    assert rows == [(0.2, "seq-mean-token-mean", False, False, False),
                    (0.2, "seq-mean-token-mean", True, False, False),
                    (0.28, "seq-mean-token-mean", True, False, False),
                    (0.28, "seq-mean-token-mean", True, True, False),
                    (0.28, "token-mean", True, True, False),
                    (0.28, "token-mean", True, True, True)]
    # the config file as written is the DAPO row; the rows share every other setting
    plain = _flat(to_dict(load_config(str(config_path(study)), [])))
    dapo = _resolved(study, study.variants[5])
    assert dapo == plain
    grpo = _resolved(study, study.variants[0])
    assert {k for k in plain if plain[k] != grpo[k]} == set(SWITCHES)
    assert (plain["algo.filter_metric"], plain["reward.answer_fallback"], plain["algo.clip_ratio_c"]) == \
        ("acc", "none", None)
    assert "algo.kl_coef" not in plain  # DAPO has no KL term: there is no setting for one


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_contrasts_differ_in_exactly_their_switch(name):
    study = STUDIES[name]()
    by_key = {v.key: v for v in study.variants}
    assert len(by_key) == len(study.variants)
    expected = {"clip-higher": {"algo.eps_high"}, "dynamic sampling": {"algo.dynamic_sampling"},
                "void-turn filter": {"algo.void_turn_filter"}}
    for c in study.contrasts:
        off, on = _resolved(study, by_key[c.off]), _resolved(study, by_key[c.on])
        assert {k for k in off if off[k] != on[k]} == expected[c.label.split(":")[0]]
    assert len(study.contrasts) == {"dapo-small": 2, "tool": 1}.get(name, 0)


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_every_study_run_generates_in_rounds(name):
    """Equal budgets count finished responses; a stream's aborted ones are not counted."""
    study = STUDIES[name]()
    assert all(_resolved(study, v)["rollout.streaming"] is False for v in study.variants)


def test_plan_gives_every_run_the_budget_and_its_seed():
    study = STUDIES["dapo-small"]()
    runs = plan(study, ("eval.every_steps=2",))
    assert len(runs) == len(study.variants) * len(study.seeds) == 21
    assert len({r.name for r in runs}) == 21 and len({r.fingerprint for r in runs}) == 21
    for run in runs:
        cfg = load_config(str(config_path(study)), list(run.overrides))
        assert cfg.train.rollout_budget == study.budget and cfg.train.seed == run.seed
        assert cfg.eval.every_steps == 2  # the command line's overrides come last


def test_a_stored_result_of_other_inputs_is_stale(tmp_path):
    """A result is reused only for the same overrides, config text and base weights."""
    study = STUDIES["dapo-small"]()
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights 1")
    digest = inputs_digest(study, base)
    run = plan(study, (), digest)[0]
    path = result_path(tmp_path, run)
    path.parent.mkdir()
    path.write_text(json.dumps({"fingerprint": run.fingerprint, "curves": {}}))
    assert load_done(tmp_path, run) is not None and inputs_digest(study, base) == digest
    (base / "model.safetensors").write_bytes(b"weights 2")  # a rebuilt base
    assert load_done(tmp_path, plan(study, (), inputs_digest(study, base))[0]) is None
    assert load_done(tmp_path, plan(study, ("eval.every_steps=2",), digest)[0]) is None
    assert load_done(tmp_path, plan(study, (), digest)[0]) is not None


def _result(variant: str, seed: int, acc: list[float], entropy: list[float], samples_per_step: int = 10) -> dict:
    steps = range(len(acc))
    return {"variant": variant, "seed": seed, "curves": {
        "val/acc_avg_at_k": [[s, a] for s, a in zip(steps, acc)],
        "actor/entropy": [[s, e] for s, e in zip(steps, entropy)],
        "response_length/mean": [[s, 10.0 * s] for s in steps],
        "response_length/clip_ratio": [[s, 0.0] for s in steps],
        "rollout/samples_total": [[s, samples_per_step * s] for s in steps]}}


def test_table_and_contrasts_by_hand(tmp_path):
    study = Study(name="t", config="c.yaml", base="steps", seeds=(1, 2), budget=100, target=0.5,
                  variants=(Variant(key="a", label="A", overrides=()), Variant(key="b", label="B", overrides=())),
                  contrasts=(Contrast(label="b vs a", off="a", on="b"),))
    results = [_result("a", 1, [0.1, 0.3, 0.6], [1.0, 0.8, 0.6]),
               _result("a", 2, [0.2, 0.4, 0.4], [1.0, 0.9, 0.8]),
               _result("b", 1, [0.1, 0.5, 0.7], [1.0, 1.0, 1.0]),
               _result("b", 2, [0.2, 0.2, 0.8], [1.0, 1.0, 0.7])]
    md = report.table(study, results)
    # A: final 0.6, 0.4 -> 0.500 ± 0.141; reached 0.5 only seed 1, at step 2 after 20 responses;
    # late entropy = mean of the last 3 steps: 0.8 and 0.9; length: (0 + 10 + 20) / 3
    assert ("| A | 0.150 ± 0.071 | 0.500 ± 0.141 | 2.0 ± 0.0 (1/2) | 20 ± 0 | 0.850 ± 0.071 | 10.0 ± 0.0 | "
            "0.000 ± 0.000 | 2.0 ± 0.0 |") in md
    # B: final 0.7, 0.8; steps to 0.5: 1 and 2 -> 1.5 ± 0.7; late entropy 1.0 and 0.9
    assert "| B | 0.150 ± 0.071 | 0.750 ± 0.071 | 1.5 ± 0.7 (2/2) | 15 ± 7 | 0.950 ± 0.071 |" in md
    # paired by seed: final +0.1, +0.4 -> 0.250 ± 0.212; entropy 1.0-0.8=0.2, 0.9-0.9=0 -> 0.100 ± 0.141
    assert "| b vs a | 0.250 ± 0.212 | 0.100 ± 0.141 | 0.0 ± 0.0 | 0.0 ± 0.0 | 2 |" in report.contrasts(study, results)
    report.plot(study, results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    report.write_json(study, results, tmp_path / "r.json", wall_seconds=1.0)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["runs"]) == 4 and doc["runs"][0]["summary"]["steps_to_target"] == 2
    assert first_reaching([[0, 0.1], [4, 0.5]], 0.5) == 4 and first_reaching([[0, 0.1]], 0.5) is None


def _ablate(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "ablate.py"), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=900)


def test_command_line_refuses_bad_input(tmp_path, python_env):
    for args, message in ((["--variants", "nope"], "unknown variant"), (["--jobs", "0"], "--jobs"),
                          (["algo.eps_hgh=1"], "eps_high")):
        proc = _ablate(["--out", str(tmp_path / "o"), *args], python_env, tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def seconds_base(tmp_path_factory) -> Path:
    """A steps base trained for a few steps (evaluated on 8 prompts): the study finds it current."""
    from dataclasses import replace

    from megatron_dapo.tiny.base import build_tiny_base
    from megatron_dapo.tiny.steps_base import steps_recipe

    recipe = steps_recipe()
    out = tmp_path_factory.mktemp("base") / "steps_base"
    small_eval = recipe.val_spec.replace("n=256", "n=8")
    build_tiny_base(out, replace(recipe.settings, max_steps=3), recipe=replace(recipe, val_spec=small_eval),
                    progress=False)
    return out


@pytest.mark.slow
def test_study_smoke_two_steps_and_resume(tmp_path, python_env, seconds_base):
    """dapo-small's dynamic-sampling contrast (two variants), two steps each; then run again."""
    out = tmp_path / "study"
    args = ["--study", "dapo-small", "--variants", "token_loss", "dapo", "--seeds", "1", "--budget", "100000",
            "--jobs", "2", "--out", str(out), f"model.hf_dir={seconds_base}", "train.steps=2",
            "train.prompt_batch_size=4", "train.mini_batch_size=2", "algo.group_size=4", "algo.max_gen_rounds=2",
            "eval.every_steps=1", "eval.max_prompts=8", "eval.n_samples=2", "rollout.max_response_len=24",
            "reward.overlong_cache_len=8", "data.train_path=builtin:steps?n=64&seed=0&split=train&max_steps=2"]
    info = (seconds_base / "base_info.json").read_bytes()
    proc = _ablate(args, python_env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (seconds_base / "base_info.json").read_bytes() == info  # current: not rebuilt
    doc = json.loads((out / "results.json").read_text())
    assert doc["study"] == "dapo-small" and doc["wall_seconds"] > 0
    assert sorted((r["variant"], r["seed"]) for r in doc["runs"]) == [("dapo", 1), ("token_loss", 1)]
    for run in doc["runs"]:
        curves = run["curves"]
        assert [s for s, _ in curves["val/acc_avg_at_k"]] == [0, 1, 2]
        for tag in ("actor/entropy", "response_length/mean", "rollout/kept_group_frac", "rollout/samples_total"):
            if tag != "actor/entropy" or run["variant"] == "token_loss":  # dapo may skip an update: no entropy
                assert [s for s, _ in curves.get(tag, [])] == [1, 2], (run["variant"], tag)
    assert (out / "study.png").stat().st_size > 10_000
    table = (out / "table.md").read_text()
    assert "| + token-level loss |" in table and "| + dynamic sampling (DAPO) |" in table
    assert "| dynamic sampling: off -> on (rest DAPO) |" in table
    assert "| naive GRPO |" not in table
    stored = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert sorted(stored) == ["dapo_seed1.json", "token_loss_seed1.json"]

    (out / "runs" / "dapo_seed1.json").unlink()  # as if the study had been killed during that run
    proc = _ablate(args, python_env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert after.keys() == stored.keys() and after["token_loss_seed1.json"] == stored["token_loss_seed1.json"]
    assert len(json.loads((out / "wall_time.json").read_text())) == 2


def test_seed_mean_interpolates_when_seeds_share_no_x():
    """Under dynamic sampling each seed logs a different responses-generated axis: the mean is taken on
    the seeds' own x values inside the common range, each seed interpolated linearly (hand values)."""
    from megatron_dapo.study.report import _seed_mean

    same = _seed_mean([([0, 1, 2], [0.0, 1.0, 2.0]), ([0, 1, 2], [2.0, 3.0, 4.0])])
    assert same == ([0, 1, 2], [1.0, 2.0, 3.0])
    xs, ys = _seed_mean([([0, 10, 20], [0.0, 1.0, 2.0]), ([5, 15, 30], [1.0, 2.0, 3.0])])
    assert xs == [5, 10, 15, 20]  # the range both cover: [5, 20]
    # seed 1 at 5/10/15/20: 0.5, 1, 1.5, 2; seed 2: 1, 1.5, 2, 2 + 5/15
    assert ys == pytest.approx([0.75, 1.25, 1.75, (2.0 + 2.0 + 1 / 3) / 2])


def test_a_studys_own_monitors_are_reported_late_and_paired(tmp_path):
    """The tool study's extra columns: a tag's mean over a run's last 3 steps, per variant and per contrast; its
    own figure panels."""
    study = Study(name="t", config="c.yaml", base="tool", seeds=(1, 2), budget=100, target=0.5,
                  variants=(Variant(key="a", label="A", overrides=()), Variant(key="b", label="B", overrides=())),
                  contrasts=(Contrast(label="b vs a", off="a", on="b"),),
                  late=(("tool/calls_per_sample", "calls"),),
                  panels=(("tool/calls_per_sample", "step", "calls per sample"),))
    results = []
    for variant, seed, calls in (("a", 1, [0.0, 0.2, 0.4, 0.6]), ("a", 2, [0.0, 0.1, 0.2, 0.3]),
                                 ("b", 1, [0.0, 0.5, 0.5, 0.8]), ("b", 2, [0.0, 0.3, 0.3, 0.3])):
        r = _result(variant, seed, [0.1, 0.2, 0.3, 0.4], [1.0] * 4)
        r["curves"]["tool/calls_per_sample"] = [[s, c] for s, c in enumerate(calls)]
        results.append(r)
    md = report.table(study, results)
    assert "| calls (late) |" in md.splitlines()[0] and md.splitlines()[1].count("---") == 10
    assert md.splitlines()[2].endswith("| 0.300 ± 0.141 |")  # A: (0.2+0.4+0.6)/3 = 0.4 and 0.2
    # paired: B - A = 0.6 - 0.4 and 0.3 - 0.2
    assert "| 0.150 ± 0.071 | 2 |" in report.contrasts(study, results)
    report.plot(study, results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 5_000

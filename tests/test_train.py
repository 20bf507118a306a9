"""The DAPO trainer end to end on CPU: every monitor written and finite, SIGKILL + resume replays
exactly, the final policy exports to HF, dry-run and config errors. `slow`: the full tiny run learns."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO, TAGS, TOOL_TAGS, kill_job_at, run_train, train_cmd

from megatron_dapo.metrics import MetricsWriter, read_scalars, read_texts


def test_three_steps_write_every_monitor(base_dir, tmp_path, python_env):
    r = run_train(train_cmd(base_dir, tmp_path, "smoke", "train.steps=3", "checkpoint.save_every=0"), python_env)
    assert "the first step took" in r.stderr and "the 2 step(s) left + 2 evaluation(s)" in r.stderr
    tb = read_scalars(tmp_path / "tb" / "smoke")
    for tag in TAGS:
        assert tag in tb, f"missing tag {tag}"
        assert all(math.isfinite(v) for v in tb[tag].values()), tag
    assert not set(TOOL_TAGS) & set(tb)  # single-turn: no tool monitors
    assert set(tb["actor/pg_loss"]) == {1, 2, 3}
    assert set(tb["val/acc_avg_at_k"]) == {0, 2, 3}  # before training, every 2 steps, at the end
    assert 0 <= tb["train/acc_mean"][1] <= 1 and tb["response_length/max"][1] <= 24
    assert tb["rollout/train_rollout_logprob_absdiff"][1] < 1e-4  # engine and actor hold the same weights
    assert (tmp_path / "tb" / "smoke" / "summary.png").is_file()
    hf = tmp_path / "ckpt" / "smoke" / "hf_final"
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
    assert (tmp_path / "ckpt" / "smoke" / "step_00000003" / "COMPLETE").is_file()


@pytest.mark.parametrize("extra, present, absent", [
    (["algo.rollout_correction=token_tis"],
     ["rollout_corr/weight_mean", "rollout_corr/weight_max", "rollout_corr/clipped_frac", "rollout_corr/kl_k3",
      "rollout_corr/ppl_ratio"], ["rollout_corr/masked_frac"]),
    (["algo.rollout_correction=seq_mis"], ["rollout_corr/masked_frac"], ["rollout_corr/clipped_frac"]),
    (["algo.old_logprob_source=rollout", "algo.clip_ratio_c=3.0"], ["actor/clipfrac_dual"], ["rollout_corr/weight_mean"]),
])
def test_rollout_correction_and_rollout_logprobs_runs(base_dir, tmp_path, python_env, extra, present, absent):
    """The rollout-correction and rollout-logprob switches in a real run: the tags are written and finite;
    with the same weights in engine and actor (fp32, CPU) the ratio pi_old / pi_rollout is 1, so every
    weight is 1 and nothing is cut."""
    run_train(train_cmd(base_dir, tmp_path, "corr", "train.steps=2", "checkpoint.save_every=0",
                        "eval.every_steps=0", *extra), python_env)
    tb = read_scalars(tmp_path / "tb" / "corr")
    for tag in present + ["actor/entropy", "actor/pg_loss", "timing/old_logprob_s"]:
        assert tag in tb and all(math.isfinite(v) for v in tb[tag].values()), tag
    assert not set(absent) & set(tb)
    if "rollout_corr/weight_mean" in tb:
        assert all(abs(v - 1) < 1e-3 for v in tb["rollout_corr/weight_mean"].values())
        assert all(abs(v) < 1e-6 for v in tb["rollout_corr/kl_k3"].values())
    if "algo.old_logprob_source=rollout" in extra:
        assert all(v == 0.0 for v in tb["rollout/train_rollout_logprob_absdiff"].values())
        assert all(v < 0.05 for v in tb["timing/old_logprob_s"].values())  # the pi_old pass is skipped


def test_sigkill_and_resume_replays_exactly(base_dir, tmp_path, python_env):
    steps = ["train.steps=4", "checkpoint.save_every=1", "eval.every_steps=0"]
    run_train(train_cmd(base_dir, tmp_path, "straight", *steps), python_env)
    marker = tmp_path / "ckpt" / "killed" / "step_00000002" / "COMPLETE"
    kill_job_at(train_cmd(base_dir, tmp_path, "killed", *steps), python_env, marker)
    assert marker.exists(), "the run never reached its step-2 checkpoint"
    assert not (tmp_path / "ckpt" / "killed" / "step_00000004").exists()
    run_train(train_cmd(base_dir, tmp_path, "killed", *steps, "checkpoint.resume=auto"), python_env)
    a, b = read_scalars(tmp_path / "tb" / "straight"), read_scalars(tmp_path / "tb" / "killed")
    for tag in TAGS:
        if tag.startswith(("timing/", "perf/", "val/")):
            continue
        for step in (3, 4):
            assert a[tag][step] == b[tag][step], (tag, step, a[tag][step], b[tag][step])


def test_dry_run_and_config_errors(python_env, base_dir):
    cfg = str(REPO / "examples/configs/tiny_cpu.yaml")
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", cfg, "--dry-run",
                        f"model.hf_dir={base_dir}"],
                       capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 0 and "group_size: 8" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", cfg, "algo.eps_hgh=1"],
                       capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 2 and "algo.eps_hgh" in r.stderr and "Traceback" not in r.stderr
    # the error is the first line: megatron-core's import-time warnings stay out of our command lines
    assert r.stderr.splitlines()[0].startswith("config error:") and "algo.eps_high" in r.stderr.splitlines()[0], \
        r.stderr


def test_missing_base_model_is_a_clear_error(tmp_path, python_env):
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config",
                        str(REPO / "examples/configs/tiny_cpu.yaml"), f"model.hf_dir={tmp_path / 'nope'}"],
                       capture_output=True, text=True, env=python_env, timeout=300, cwd=tmp_path)
    # (cwd: not the checkout, where CI's README command 1 has left a finished tiny_cpu run: "nothing to train")
    assert r.returncode == 2 and str((tmp_path / "nope").resolve()) in r.stderr, r.stderr
    assert "make_tiny_base" not in r.stderr  # only the tiny base can be built for you


def test_missing_model_folder_names_its_absolute_path(tmp_path, monkeypatch):
    from megatron_dapo.loop.preflight import SetupError, check_model

    monkeypatch.chdir(tmp_path)
    for name, tiny in (("models/my-model", False), ("checkpoints/tiny_base", True)):
        with pytest.raises(SetupError) as e:
            check_model(name)
        assert str(tmp_path / name) in str(e.value) and ("make_tiny_base" in str(e.value)) == tiny, e.value


def test_ctrl_c_says_how_to_resume_and_what_saves(tmp_path):
    from megatron_dapo.train import interrupted_line

    for last in (tmp_path / "step_00000003", None):
        line = interrupted_line(last)
        assert "rerun the same command" in line and "SIGTERM" in line and str(last or "no checkpoint") in line


def test_rerunning_a_finished_run_says_so(tmp_path, capsys):
    """checkpoint.resume=auto at or past train.steps with hf_final exported: one line naming how to start
    fresh, nothing built (model.hf_dir does not exist). Without hf_final the run starts, to export it."""
    from megatron_dapo.actor.checkpoint import step_dir
    from megatron_dapo.config import load_config
    from megatron_dapo.loop.preflight import SetupError
    from megatron_dapo.train import train

    from megatron_dapo.actor.checkpoint_files import write_manifest

    root = tmp_path / "ckpt" / "done"
    (step_dir(root, 40)).mkdir(parents=True)
    (step_dir(root, 40) / "model.bin").write_bytes(b"weights")
    write_manifest(step_dir(root, 40), collective=False)
    (step_dir(root, 40) / "COMPLETE").touch()
    def cfg(steps):
        return load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "logging.run_name=done", f"train.steps={steps}",
                                  f"model.hf_dir={tmp_path / 'no_model'}", f"logging.tensorboard_dir={tmp_path / 'runs'}"])
    from megatron_dapo import parallel

    with pytest.raises(SetupError):  # hf_final missing: it starts (and fails on the missing model here)
        try:
            train(cfg(10))
        finally:
            parallel.destroy()
    (root / "hf_final").mkdir()
    (root / "hf_final" / "config.json").write_text("{}")
    capsys.readouterr()
    for steps in (40, 10):
        assert train(cfg(steps)) == {}
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "step 40" in err and f"train.steps={steps}" in err, err
        assert "logging.run_name" in err and "checkpoint.resume=none" in err, err
    for corrupt in (False, True):  # more steps: it continues; a corrupt newest one is skipped by the resume
        if corrupt:
            (step_dir(root, 40) / "model.bin").write_bytes(b"weigh")
        with pytest.raises(SetupError):
            try:
                train(cfg(41 if not corrupt else 40))
            finally:
                parallel.destroy()


@pytest.mark.slow
def test_full_tiny_run(tmp_path, python_env):
    """README command 1 end to end: builds the base if needed, trains, evaluates, exports.

    With MEGATRON_DAPO_TINY_RUN=<repo root> (set by .ci/run, whose README command 1 has just run it
    there), the checks read that run's outputs (runs/tiny_cpu, checkpoints/tiny_cpu) instead of
    training a second time."""
    t0 = time.time()
    done = os.environ.get("MEGATRON_DAPO_TINY_RUN")
    if done:
        tb_root, ckpt_root = Path(done) / "runs", Path(done) / "checkpoints"
        assert (tb_root / "tiny_cpu").is_dir(), f"MEGATRON_DAPO_TINY_RUN={done}: no runs/tiny_cpu there"
    else:
        tb_root, ckpt_root = tmp_path / "tb", tmp_path / "ckpt"
        r = subprocess.run(["bash", str(REPO / "examples/run_dapo_tiny.sh"), f"checkpoint.dir={ckpt_root}",
                            f"logging.tensorboard_dir={tb_root}"], capture_output=True, text=True,
                           env=python_env, timeout=1800, cwd=REPO)
        assert r.returncode == 0, r.stderr[-6000:]
    minutes = (time.time() - t0) / 60
    tb = read_scalars(tb_root / "tiny_cpu")
    for tag in TAGS:
        assert tag in tb and all(math.isfinite(v) for v in tb[tag].values()), tag
    val = tb["val/acc_avg_at_k"]
    assert sorted(val) == [0, 10, 20, 30, 40]
    assert val[40] >= val[0] + 0.15, val  # it visibly learns (measured: +26 points; see docs/study_dapo_small/README.md)
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4
    assert (tb_root / "tiny_cpu" / "summary.png").is_file()
    assert (ckpt_root / "tiny_cpu" / "hf_final" / "model.safetensors").is_file()
    print(f"tiny run: {minutes:.1f} min, val avg@4 {val[0]:.3f} -> {val[40]:.3f}")


def test_summary_after_a_resume_covers_the_whole_run(tmp_path):
    """MetricsWriter.load_history: curves from the earlier event files up to the resumed step, the last
    written value winning for a replayed step, then the new steps."""
    first = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        first.write(step, {"train/reward_mean": float(step), "actor/grad_norm": 9.0})
    first.close()
    time.sleep(0.05)  # event files are ordered by modification time
    replay = MetricsWriter(tmp_path)
    replay.write(3, {"train/reward_mean": 30.0})  # a step replayed after a crash
    replay.close()
    resumed = MetricsWriter(tmp_path)
    resumed.load_history(until_step=3)
    resumed.write(4, {"train/reward_mean": 4.0})
    assert resumed.history["train/reward_mean"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 4.0}
    assert "actor/grad_norm" not in resumed.history  # only the plotted curves are read back
    assert resumed.summary_png() == tmp_path / "summary.png" and (tmp_path / "summary.png").is_file()
    resumed.close()


def test_tensorboard_drops_the_steps_redone_after_a_resume(tmp_path):
    """The resumed writer's purge_step: TensorBoard shows each redone step once, with the redone value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsWriter(tmp_path)
    for step in range(1, 6):
        first.write(step, {"train/reward_mean": float(step)})
    first.close()  # killed after step 5; its checkpoint is step 3
    resumed = MetricsWriter(tmp_path)
    resumed.load_history(until_step=3)
    for step in (4, 5):
        resumed.write(step, {"train/reward_mean": 10.0 * step})
    resumed.close()
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    shown = [(e.step, e.value) for e in ea.Scalars("train/reward_mean")]
    assert shown == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]


def test_the_summary_has_a_headline_and_only_the_curves_the_run_has(tmp_path):
    """Updates skipped and evaluation off: no empty panels; accuracy and time get theirs; the title names the
    run and its validation accuracy from first to last."""
    writer = MetricsWriter(tmp_path / "my-run")
    writer.write(0, {"val/acc_avg_at_k": 0.25})
    for step in (1, 2):
        writer.write(step, {"train/acc_mean": 0.5, "train/reward_mean": 0.1 * step, "timing/step_s": 30.0})
    writer.write(2, {"val/acc_avg_at_k": 0.75})
    panels = {title: [tag for tag, _ in curves] for title, curves in writer.summary_panels()}
    assert panels == {"accuracy": ["val/acc_avg_at_k", "train/acc_mean"], "reward": ["train/reward_mean"],
                      "seconds per step": ["timing/step_s"]}
    headline = writer.headline()
    assert headline.startswith("my-run: 2 steps") and "0.250" in headline and "0.750" in headline, headline
    assert "1.0 min" in headline, headline
    assert writer.summary_png() == tmp_path / "my-run" / "summary.png"
    writer.close()


def test_a_writer_that_never_wrote_leaves_no_folder(tmp_path):
    MetricsWriter(tmp_path / "runs" / "failed").close()
    assert not (tmp_path / "runs" / "failed").exists()


def test_sample_texts_read_back_per_split_and_step(tmp_path):
    """read_texts: write_samples' TensorBoard text per split and step, a replayed step's last text winning."""
    def records(prompt):
        return [{"uid": "u0", "ground_truth": "1", "prompt": prompt, "response": "Answer: 1", "reward": 1.0,
                 "acc": True, "length": 3}]

    first = MetricsWriter(tmp_path)
    first.write_samples(1, "val", records("1+0="))
    first.close()
    time.sleep(0.05)  # event files are ordered by modification time
    replay = MetricsWriter(tmp_path)
    replay.write_samples(1, "val", records("2+0="))
    replay.write_samples(2, "train", records("3+0="))
    replay.close()
    texts = read_texts(tmp_path)
    assert {split: set(steps) for split, steps in texts.items()} == {"samples/val": {1}, "samples/train": {2}}
    assert "2+0=" in texts["samples/val"][1] and "1+0=" not in texts["samples/val"][1]
    train = texts["samples/train"][2]
    assert train.startswith("**prompt** (u0, truth 1)") and "3+0=" in train

"""The first-contact summary (metrics/phase_summary.py): one line per phase from a run's TensorBoard scalars and
checkpoint folder, and a failure naming a phase that left no trace."""

from __future__ import annotations

from torch.utils.tensorboard import SummaryWriter

from megatron_dapo.metrics import phase_summary

RUN = {"timing/rollout_s": {1: 10.0, 2: 20.0}, "response_length/mean": {1: 300.0, 2: 100.0},
       "memory/device_used_generate": {1: 2.0 * 2**30}, "timing/old_logprob_s": {1: 1.0, 2: 1.0},
       "timing/update_s": {1: 4.0, 2: 6.0}, "train/reward_mean": {1: 0.5, 2: 0.25},
       "timing/weight_sync_s": {1: 2.0, 2: 2.0}, "rollout/weight_sync_probe_absdiff": {1: 0.001, 2: 0.0},
       "perf/weight_sync_bytes": {1: 1e6}, "timing/eval_s": {2: 5.0}, "val/acc_avg_at_k": {2: 0.5}}


def _write(logdir, scalars):
    w = SummaryWriter(str(logdir))
    for tag, series in scalars.items():
        for step, value in series.items():
            w.add_scalar(tag, value, step)
    w.close()


def test_every_phase_gets_one_line(tmp_path, capsys):
    _write(tmp_path / "tb", RUN)
    ckpt = tmp_path / "ckpt"
    for d in ("step_2", "step_3", "hf_final"):
        (ckpt / d).mkdir(parents=True)
    assert phase_summary.main(["--logdir", str(tmp_path / "tb"), "--checkpoints", str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "phase generate: ok, 2 step(s), 15.0 s mean, response length 100, device used 2.0 GiB",
        "phase pi_old: ok, 2 step(s), 1.0 s mean",
        "phase train: ok, 2 step(s), 5.0 s mean, reward 0.25",
        "phase sync: ok, 2 step(s), 2.0 s mean, probe |diff| max 0.001, bytes 1e+06",
        "phase eval: ok, 1 step(s), 5.0 s mean, acc 0.5",
        f"phase checkpoint: ok, 2 saved (step_3 newest) + hf_final in {ckpt}",
        "first contact: every phase ran"]


def test_a_phase_without_a_trace_fails_the_check(tmp_path, capsys):
    _write(tmp_path / "tb", {k: v for k, v in RUN.items() if k != "timing/eval_s"})
    assert phase_summary.main(["--logdir", str(tmp_path / "tb"), "--checkpoints", str(tmp_path / "none")]) == 1
    out = capsys.readouterr().out
    assert "phase eval: NOT RUN (no timing/eval_s)" in out and "phase checkpoint: NOT RUN" in out
    assert out.rstrip().endswith("first contact: a phase did not run (above)")

"""After every weight sync the engine's weights are the actor's (loop/weight_probe.py), and the phase protocol
syncs again whenever the engine's weights were released: a checkpoint save used to release them (CUDA's
memory saver keeps no copy) and the next rollout generated from whatever the memory held.

The embedded engine loses released weights as SGLang on CUDA does (NaN when they come back), so a protocol
that forgets to sync fails here as it would on a GPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.loop.weight_probe import PROMPT_LEN, TOLERANCE, WeightProbe, WeightSyncError, probe_tokens
from megatron_dapo.rollout.embedded import EmbeddedEngine

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train.prompt_batch_size=8", "train.mini_batch_size=4", "algo.group_size=4", "eval.every_steps=0",
         "algo.filter_metric=score", "checkpoint.export_hf=false", "data.val_path=", "train.deterministic=true"]


class ScoredEngine(EmbeddedEngine):
    """An embedded engine whose scores are shifted by `shift` (or that fails to score)."""

    def __init__(self, model, shift=0.0, fail=False):
        super().__init__(model)
        self.shift, self.fail = shift, fail

    def score(self, token_ids, start):
        if self.fail:
            raise RuntimeError("server gone")
        return [[x + self.shift for x in scored] for scored in super().score(token_ids, start)]


@pytest.fixture(scope="module")
def model():
    from megatron_dapo.tiny import tiny_model

    return tiny_model("qwen2", seed=0)


def expected_logprobs(model, tokens):
    with torch.no_grad():
        logp = model(torch.tensor([tokens])).logits[0].double().log_softmax(-1)
    return logp[PROMPT_LEN - 1:-1].gather(-1, torch.tensor(tokens[PROMPT_LEN:])[:, None]).squeeze(-1)


def test_the_probe_is_fixed_and_the_engine_scores_it_teacher_forced(model):
    tokens = probe_tokens(model.config.vocab_size)
    assert tokens == probe_tokens(model.config.vocab_size) and max(tokens) < model.config.vocab_size
    (scored,) = EmbeddedEngine(model).score(tokens, PROMPT_LEN)
    assert torch.allclose(torch.tensor(scored, dtype=torch.float64), expected_logprobs(model, tokens), atol=1e-5)


@pytest.mark.parametrize("shift, fail, stops", [(0.0, False, False), (0.005, False, False), (0.02, False, True),
                                                (math.nan, False, True), (0.0, True, True)])
def test_the_probe_stops_above_the_dtype_tolerance(model, shift, fail, stops):
    probe = WeightProbe.for_actor(model.config.vocab_size, torch.float32)
    assert probe.tolerance == TOLERANCE[torch.float32] == 1e-2
    expected = expected_logprobs(model, probe.tokens)
    engine = ScoredEngine(model, shift, fail)
    if not stops:
        assert probe.check(engine, expected, step=7) == pytest.approx(shift, abs=1e-5)
        return
    with pytest.raises(WeightSyncError, match="weights differ from the actor's after the sync at step 7") as e:
        probe.check(engine, expected, step=7)
    assert ("server gone" in str(e.value)) == fail


def train_cmd(base_dir, root, *extra, script=("-m", "megatron_dapo.train")):
    return [sys.executable, *script, "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
            f"model.hf_dir={base_dir}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
            "logging.run_name=probe", *SMALL, *extra]


def test_a_checkpoint_save_does_not_leave_the_engine_on_lost_weights(base_dir, tmp_path, python_env):
    """A save after every step wakes the actor and releases the engine: its weights are synced again before
    the next rollout, so the rollout/train logprob gap stays at its normal level at every step (it was NaN:
    the engine generated from lost weights) and every sync passes the probe."""
    from megatron_dapo.metrics import read_scalars

    r = subprocess.run(train_cmd(base_dir, tmp_path, "train.steps=3", "checkpoint.save_every=1"),
                       capture_output=True, text=True, env=python_env, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "probe")
    assert sorted(tb["rollout/train_rollout_logprob_absdiff"]) == [1, 2, 3]
    assert all(v < 1e-4 for v in tb["rollout/train_rollout_logprob_absdiff"].values()), tb
    assert all(v < 1e-4 for v in tb["rollout/weight_sync_probe_absdiff"].values())


def test_a_broken_sync_stops_the_run_naming_the_step(base_dir, tmp_path, python_env):
    worker = str(REPO / "tests" / "workers" / "broken_sync_worker.py")
    r = subprocess.run(train_cmd(base_dir, tmp_path, "train.steps=3", "checkpoint.save_every=0", script=(worker,)),
                       capture_output=True, text=True, env=python_env, timeout=900)
    assert r.returncode == 1, r.stderr[-4000:]
    assert "the rollout engine's weights differ from the actor's after the sync at step 1" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.sglang
@pytest.mark.timeout(1500)
def test_sglang_after_every_save_the_engine_is_synced_again(sglang_python, base_dir, tmp_path, python_env):
    """The same on a real SGLang server (its CPU shim loses released memory as the CUDA memory saver does):
    the logprob gap stays at fp32 rounding at every step although every step ends with a save, the probe
    passes after every sync, and the server was started with the actor asleep."""
    from sglang_support import server_ports

    from megatron_dapo.metrics import read_scalars

    cmd = train_cmd(base_dir, tmp_path, "train.steps=3", "checkpoint.save_every=1", "rollout.engine=sglang",
                    f"rollout.sglang.base_port={server_ports()}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1400,
                       env={**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python})
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "probe")
    assert sorted(tb["rollout/train_rollout_logprob_absdiff"]) == [1, 2, 3]
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4, tb
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 1e-4
    assert "started with the actor asleep" in r.stderr

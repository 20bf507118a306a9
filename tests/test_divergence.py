"""An update that explodes stops the run with one line naming the step and the cause, exit 1, and
no checkpoint of its weights; on both engines and in both rollout modes.

Two places catch it where it first appears: the optimizer step's result (inf/NaN weights, or weights whose norm
grew more than MAX_NORM_GROWTH times in one update: an exploded update leaves finite weights that give inf/NaN
logits for some inputs only, which the old finiteness check passed and saved), and the engines' logits
(embedded: before sampling, which returned an id outside the vocabulary; SGLang: null/NaN logprobs or
out-of-vocabulary ids in /generate's answer).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import one_line, run, train_cmd

from megatron_dapo.rollout import EmbeddedEngine, NonFiniteLogitsError, SamplingParams
from megatron_dapo.rollout.base import GroupRequest
from megatron_dapo.rollout.sglang.wire import parse_generate_response
from megatron_dapo.tiny import tiny_model

STEPS = ["train.steps=3", "eval.every_steps=0", "checkpoint.save_every=1"]
# An in-range setting whose first update explodes: AdamW's decay multiplies each weight by 1 - lr * wd
# (about -3e25 here), finite weights that overflow the first matmul. (lr itself is bounded: (0, 1].)
EXPLODE = "actor.optimizer.weight_decay=1e30"
MODES = {"streaming": "rollout.streaming=true", "rounds": "rollout.streaming=false"}
# the default (streaming) in the CPU tier, rounds in the slow tier
TIERED_MODES = [pytest.param(m, marks=pytest.mark.slow) if m == "rounds" else m for m in MODES]


def nan_base(base_dir: Path, tmp_path: Path) -> Path:
    """The tiny base with one NaN weight matrix (a corrupt checkpoint that loads): every logit is NaN."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "nan_base"
    shutil.copytree(base_dir, hf)
    weights = load_file(hf / "model.safetensors")
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    weights[name] = torch.full_like(weights[name], math.nan)
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return hf


def assert_nothing_saved(root: Path, run_name: str) -> None:
    folder = root / "ckpt" / run_name
    assert not any(folder.glob("step_*")) and not (folder / "hf_final").exists(), sorted(folder.iterdir())


# ------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("mode", TIERED_MODES)
def test_an_exploding_update_stops_the_run_in_one_line(base_dir, tmp_path, env, mode):
    r = run(train_cmd(base_dir, tmp_path, "boom", *STEPS, EXPLODE, MODES[mode]), env)
    line = one_line(r, 1, "step 1: the last update diverged: it ", "(update 1: lr 3.33333e-05, grad norm ")
    assert "stopped before its weights were synced or saved (lower actor.optimizer.lr?)" in line, line
    assert_nothing_saved(tmp_path, "boom")


@pytest.mark.parametrize("mode", TIERED_MODES)
def test_weights_that_give_nan_logits_stop_the_first_rollout_in_one_line(base_dir, tmp_path, env, mode):
    hf = nan_base(base_dir, tmp_path)
    r = run(train_cmd(hf, tmp_path, "nan", *STEPS, MODES[mode]), env)
    one_line(r, 1, "non-finite logits in the rollout of step 1: the weights the run started from",
             f"model.hf_dir={hf}", "logits hold inf/NaN")
    assert_nothing_saved(tmp_path, "nan")


@pytest.mark.sglang
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["streaming", "rounds"])
def test_the_same_on_sglang(sglang_python, base_dir, tmp_path, env, mode):
    """The server's non-finite logits, read by either collector, stop the run in one line with nothing saved.
    (An exploding update is the actor's, whatever the engine: test_an_exploding_update_stops_the_run_in_one_line.)"""
    from sglang_support import server_ports

    env = {**env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    r = run(train_cmd(nan_base(base_dir, tmp_path), tmp_path, "sg", *STEPS, MODES[mode], "rollout.engine=sglang",
                      f"rollout.sglang.base_port={server_ports()}"), env, timeout=1200)
    one_line(r, 1, "non-finite logits in the rollout of step 1", "the server's logits are not finite")
    assert_nothing_saved(tmp_path, "sg")


# ------------------------------------------------------------------------------------ the engines


@pytest.fixture(scope="module")
def nan_model():
    model = tiny_model("qwen2", seed=0, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(math.nan)
    return model


@pytest.mark.parametrize("fast_path", [True, False], ids=["llama_decoder", "hf_decoder"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_embedded_engine_refuses_non_finite_logits_in_both_modes(nan_model, fast_path, temperature):
    engine = EmbeddedEngine(nan_model, fast_path=fast_path)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=4)
    with pytest.raises(NonFiniteLogitsError, match="logits hold inf/NaN in 2 of 2 rows"):
        engine.generate([[1, 2, 3]], 2, sampling)
    if fast_path:  # the stream runs on the slot decoder (the Llama fast path) only
        with engine.stream() as stream:
            stream.submit([GroupRequest(key=0, prompt_ids=[1, 2, 3], n=2, sampling=sampling)])
            with pytest.raises(NonFiniteLogitsError, match="logits hold inf/NaN"):
                stream.next()


def _answer(ids, logprobs):
    return [{"output_ids": ids, "meta_info": {"finish_reason": {"type": "length"},
                                              "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}]


@pytest.mark.parametrize(("ids", "logprobs", "needle"), [
    ([0, 0], [None, None], "2 of 2 logprobs null"),  # what SGLang 0.5.23 on CPU answered for NaN logits
    ([3, 4], [-0.5, math.nan], "1 of 2 logprobs"),
    ([3, 4], [-0.5, -math.inf], "1 of 2 logprobs"),
    ([3, 64], [-0.5, -0.1], "1 token ids outside the vocabulary (64)[64]"),
    ([-1, 4], [-0.5, -0.1], "1 token ids outside"),
])
def test_a_servers_non_finite_answer_is_refused(ids, logprobs, needle):
    payload = json.loads(json.dumps(_answer(ids, logprobs)))  # NaN/inf travel as JSON does
    with pytest.raises(NonFiniteLogitsError) as e:
        parse_generate_response(payload, [[1, 2]], vocab_size=64)
    assert needle in str(e.value) and "request 0" in str(e.value)
    ok = parse_generate_response(_answer([3, 63], [-0.5, -0.25]), [[1, 2]], vocab_size=64)
    assert ok[0].response_ids == [3, 63] and ok[0].rollout_logprobs == [-0.5, -0.25]


# ------------------------------------------------------------------------- the trainer's one line


def test_the_rollout_error_names_the_step_through_every_wrapper():
    from megatron_dapo.actor.actor import NonFiniteWeightsError
    from megatron_dapo.collect.streaming import RolloutStepError
    from megatron_dapo.rollout.engine_group import EngineGroupError
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.metrics import PhaseTimer
    from megatron_dapo.schedule import Schedule

    actor: Any = SimpleNamespace(last_update="update 20: lr 0.5, grad norm 3")
    schedule = Schedule(RolloutConfig(), 10, SimpleNamespace(step=0), None, PhaseTimer(), actor,  # type: ignore[arg-type]
                        "model.hf_dir=/models/base")
    schedule.start_step = 4

    def raise_wrapped():
        try:
            try:
                raise NonFiniteLogitsError("the engine's logits hold inf/NaN in 3 of 8 rows")
            except NonFiniteLogitsError as e:
                raise EngineGroupError("generate failed on rollout engine 127.0.0.1:30000: boom") from e
        except EngineGroupError as e:
            raise RolloutStepError("streaming rollout failed", partial=None) from e

    for after, needle in [(6, "in the rollout after step 6: the last update diverged (update 20: lr 0.5"),
                          (4, "in the rollout of step 5: the weights the run started from (checkpoint step 4)")]:
        with pytest.raises(NonFiniteWeightsError) as e, schedule.checked(after_step=after):
            raise_wrapped()
        assert needle in str(e.value) and "3 of 8 rows" in str(e.value), str(e.value)
    schedule.start_step = 0
    with pytest.raises(NonFiniteWeightsError, match=r"of step 1: .* \(model.hf_dir=/models/base\)"), \
            schedule.checked(after_step=0):
        raise_wrapped()
    with pytest.raises(RolloutStepError), schedule.checked(after_step=3):
        raise RolloutStepError("another failure", partial=None)  # anything else passes through unchanged

"""Multi-turn tool rollouts (rollout/tools/): a scripted policy against hand-built token rows, the observation
tokens out of the loss, the void-turn filter, the config's refusals, and the embedded engine token in / token
out (its logprobs at every sampled position equal a teacher-forced pass over the final row)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future

import pytest
import torch

from megatron_dapo.algo.train_batch import build_train_batch, void_turn_weights
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.rollout.base import GroupRequest, RolloutEngine, SamplingParams
from megatron_dapo.rollout.tools import ToolEngine, with_tools
from megatron_dapo.sandbox import SandboxUnavailable, ToolResult, check_sandbox
from megatron_dapo.tiny.tokenizer import build_char_tokenizer
from megatron_dapo.types import FinishReason, Group, Prompt, Sample

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models gain nothing from a second thread
TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
CFG = ToolsConfig(name="python", max_calls=2, max_output_tokens=8)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedPolicy(RolloutEngine):
    """A deterministic policy over text: after k observations it writes turn k of its prompt's script (the
    rest of it, from what the current turn already holds), then EOS; it honours the stop tokens and the
    token limit as an engine does. Its logprob of the token at response position j is -(j + 1) / 100."""

    def __init__(self, scripts: dict[str, list[str]], cfg: ToolsConfig = CFG) -> None:
        self.scripts, self.cfg, self.calls = scripts, cfg, 0

    def generate(self, prompt_token_ids, n, sampling):
        self.calls += 1
        return [[self._one(list(p), sampling) for _ in range(n)] for p in prompt_token_ids]

    def _one(self, context: list[int], sampling: SamplingParams) -> Sample:
        text = TOK.decode(context)
        prompt = next(p for p in self.scripts if text.startswith(p))
        response = text[len(prompt):]
        k = response.count(self.cfg.output_open)
        turn = response.rsplit(self.cfg.output_close, 1)[-1] if k else response
        todo = ids(self.scripts[prompt][k][len(turn):]) + ([EOS] if k == len(self.scripts[prompt]) - 1 else [])
        stops = set(sampling.stop_token_ids) | {EOS}
        out: list[int] = []
        finish: FinishReason = "length"
        for t in todo[:sampling.max_new_tokens]:
            out.append(t)
            if t in stops:
                finish = "stop"
                break
        start = len(context) - len(ids(prompt))
        return Sample(prompt_ids=context, response_ids=out, finish_reason=finish,
                      rollout_logprobs=[-(start + j + 1) / 100 for j in range(len(out))])

    def update_weights(self, named_tensors): pass
    def sleep(self, tags=None): pass
    def wake(self, tags=None): pass
    def abort(self): pass
    def health(self): return True
    def shutdown(self): pass


def echo_tool(code: str) -> Future:
    """Prints what `print(...)` of the code would, by evaluating its argument (stands for the sandbox)."""
    fut: Future = Future()
    expr = code.strip().removeprefix("print(").removesuffix(")")
    fut.set_result(ToolResult("ok", f"{eval(expr)}\n", "", 0.25))  # noqa: S307 - the test's own scripts only
    return fut


def tool_engine(scripts, cfg=CFG):
    return ToolEngine(ScriptedPolicy(scripts), cfg, TOK, echo_tool, eos_ids=[EOS])


TURN0 = "I compute.\n```python\nprint(6*7)\n```"
TURN1 = "\nAnswer: 42"


def test_two_turns_token_by_token():
    engine = tool_engine({"Q:": [TURN0, TURN1]})
    [[s]] = engine.generate([ids("Q:")], 1, SamplingParams(max_new_tokens=200, seed=3))
    obs = ids(CFG.output_open) + ids("42\n") + ids(CFG.output_close)
    expected = ids(TURN0) + obs + ids(TURN1) + [EOS]
    assert s.response_ids == expected and s.finish_reason == "stop"
    a, b = len(ids(TURN0)), len(ids(TURN0)) + len(obs)
    assert s.tool.observations == [(a, b)] and s.tool.statuses == ["ok"] and s.tool.turns == 2
    assert s.observation_mask() == [a <= j < b for j in range(len(expected))]
    assert s.rollout_logprobs == [0.0 if a <= j < b else -(j + 1) / 100 for j in range(len(expected))]
    assert s.tool.last_turn_code is False
    assert Sample.from_dict(json.loads(json.dumps(dataclasses.asdict(s)))) == s  # as checkpoints keep samples

    # the trained row: prompt + every token; loss and statistics on the sampled tokens only
    s.pred = "42"
    batch = build_train_batch([Group(Prompt("u", (), "42"), [s, s])], torch.tensor([[1.0, -1.0]]))
    p = len(ids("Q:"))
    assert batch.input_ids[0, :p + len(expected)].tolist() == ids("Q:") + expected
    sampled = [0.0] * p + [0.0 if a <= j < b else 1.0 for j in range(len(expected))]
    assert batch.loss_mask[0].tolist() == sampled and batch.response_mask[0].tolist() == sampled
    assert batch.num_tokens == 2 * (len(expected) - len(obs))


def test_max_calls_output_truncation_and_the_budget():
    code = "```python\nprint(10**30)\n```"
    engine = tool_engine({"Q:": [code, code + " done"]}, ToolsConfig(name="python", max_calls=1, max_output_tokens=5))
    [[s]] = engine.generate([ids("Q:")], 1, SamplingParams(max_new_tokens=200))
    obs = ids(CFG.output_open) + ids("1" + "0" * 30 + "\n")[:5] + ids(CFG.output_close)
    assert s.response_ids == ids(code) + obs + ids(code + " done") + [EOS]  # the second block stays text
    assert s.tool.statuses == ["ok"] and s.tool.last_turn_code and s.finish_reason == "stop"

    budget = len(ids(code)) + 4  # the observation is cut by rollout.max_response_len
    [[t]] = tool_engine({"Q:": [code, "x"]}).generate([ids("Q:")], 1, SamplingParams(max_new_tokens=budget))
    assert t.response_len == budget and t.finish_reason == "length"
    assert t.tool.observations == [(len(ids(code)), budget)]


def test_void_turns_and_the_filter():
    engine = tool_engine({"A:": ["no code, no answer"], "B:": ["Answer: 7"], "C:": [TURN0, "gave up"]})
    [[a], [b], [c]] = engine.generate([ids("A:"), ids("B:"), ids("C:")], 1, SamplingParams(max_new_tokens=200))
    for s, pred in ((a, None), (b, "7"), (c, None)):
        s.pred = pred
    assert [a.void_turn, b.void_turn, c.void_turn] == [True, False, True]
    single = Sample(prompt_ids=[3], response_ids=[4], rollout_logprobs=[0.0], finish_reason="stop")
    assert void_turn_weights([Group(Prompt("u", (), "7"), [a, b, c, single])]) == [0.0, 1.0, 0.0, 1.0]


def test_seeded_calls_repeat_and_the_stream_serves_groups():
    engine = tool_engine({"Q:": [TURN0, TURN1], "R:": ["Answer: 1"]})
    with engine.stream() as stream:
        stream.submit([GroupRequest(key=5, prompt_ids=ids("Q:"), n=2, sampling=SamplingParams(seed=1)),
                       GroupRequest(key=6, prompt_ids=ids("R:"), n=2, sampling=SamplingParams(seed=2))])
        first = stream.next()
        assert first.key == 5 and stream.pending == 1
        assert stream.abort().keys == [6] and stream.pending == 0
    assert [s.response_ids for s in first.samples] == [s.response_ids for s in
                                                       engine.generate([ids("Q:")], 2, SamplingParams(seed=1))[0]]


def test_the_wrapped_engine_restarts_what_it_lost():
    """The loop revives a lost server or engine process at each phase change (loop/phases.py asks the engine it
    holds): through a ToolEngine too, and a wrapped engine that restarts nothing is left alone."""
    revived = []
    policy = ScriptedPolicy({"Q:": [TURN0, TURN1]})
    policy.revive = lambda remote=False: revived.append(remote)  # type: ignore[attr-defined]
    ToolEngine(policy, CFG, TOK, echo_tool, eos_ids=[EOS]).revive()
    ToolEngine(policy, CFG, TOK, echo_tool, eos_ids=[EOS]).revive(remote=True)  # another node's servers too
    tool_engine({"Q:": [TURN0, TURN1]}).revive()
    assert revived == [False, True]


def test_config_refuses_what_multi_turn_samples_cannot_use():
    load_config(None, ["rollout.tools.name=python", "rollout.streaming=false", "algo.void_turn_filter=true"])
    for extra, named in ((["rollout.streaming=true"], "rollout.streaming=true"),
                         (["rollout.async_steps=1", "rollout.colocate=false"], "rollout.async_steps=1"),
                         (["algo.rollout_correction=token_tis"], "algo.rollout_correction=token_tis")):
        with pytest.raises(ConfigError, match=f"does not support {named}"):
            load_config(None, ["rollout.tools.name=python", "rollout.streaming=false", *extra])
    with pytest.raises(ConfigError, match="void_turn_filter needs rollout.tools"):
        load_config(None, ["algo.void_turn_filter=true"])
    with pytest.raises(ConfigError, match="must be none, python or module.path:function"):
        load_config(None, ["rollout.tools.name=bash", "rollout.streaming=false"])


def test_embedded_engine_token_in_token_out():
    """A random tiny policy with one-character fences ("a" opens, "b" closes: random text closes blocks often):
    every sampled token's rollout logprob equals a teacher-forced pass over the final row, so each continuation
    conditioned on exactly the ids before it (observations included); observations are the tool's ids."""
    from megatron_dapo.rollout.embedded import EmbeddedEngine
    from megatron_dapo.tiny.models import tiny_model

    model = tiny_model("qwen2", vocab_size=len(TOK), seed=0)
    cfg = ToolsConfig(name="python", max_calls=3, code_open="a", code_close="b", output_open="[", output_close="]")
    seen: list[str] = []

    def tool(code: str) -> Future:
        seen.append(code)
        fut: Future = Future()
        fut.set_result(ToolResult("ok", "xyz", "", 0.0))
        return fut

    engine = ToolEngine(EmbeddedEngine(model, fast_path=False), cfg, TOK, tool, eos_ids=[EOS])
    out = engine.generate([ids("Q:"), ids("12+7=")], 4, SamplingParams(max_new_tokens=48, seed=0))
    samples = [s for g in out for s in g]
    assert seen and sum(len(s.tool.observations) for s in samples) == len(seen)
    for s in samples:
        row, p = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        [ref] = engine.score(row, p)
        mask = s.observation_mask()
        for start, end in s.tool.observations:
            assert s.response_ids[start:end] == ids("[xyz]")[:end - start]
        gaps = [abs(a - b) for a, b, obs in zip(s.rollout_logprobs, ref, mask) if not obs]
        assert max(gaps) < 1e-4


def test_the_python_tool_runs_in_the_sandbox():
    try:
        check_sandbox(CFG.sandbox())
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    engine = with_tools(ScriptedPolicy({"Q:": [TURN0, TURN1]}), CFG, TOK, [EOS])
    try:
        [[s]] = engine.generate([ids("Q:")], 1, SamplingParams(max_new_tokens=200))
    finally:
        engine.shutdown()
    a, b = s.tool.observations[0]
    assert TOK.decode(s.response_ids[a:b]) == CFG.output_open + "42\n" + CFG.output_close
    assert s.tool.statuses == ["ok"] and s.tool.seconds[0] > 0


def test_tool_monitors():
    from megatron_dapo.rollout.tools.monitors import TOOL_TAGS, tool_scalars

    engine = tool_engine({"Q:": [TURN0, TURN1], "A:": ["nothing"]})
    [[q], [a]] = engine.generate([ids("Q:"), ids("A:")], 1, SamplingParams(max_new_tokens=200))
    q.pred, a.pred = "42", None
    single = Sample(prompt_ids=[3], response_ids=[4], rollout_logprobs=[0.0], finish_reason="stop")
    assert tool_scalars([single]) == {}  # single-turn runs log no tool monitors
    out = tool_scalars([q, a])
    obs = q.tool.observations[0][1] - q.tool.observations[0][0]
    assert set(out) == set(TOOL_TAGS)
    assert out == {"tool/calls_per_sample": 0.5, "tool/error_frac": 0.0, "tool/timeout_frac": 0.0,
                   "tool/seconds": 0.25, "rollout/turns_mean": 1.5, "rollout/void_turn_frac": 0.5,
                   "rollout/observation_token_frac": obs / (q.response_len + a.response_len)}


def test_the_tool_base_is_taught_what_the_rollout_writes():
    """The tool base's warm-start target is token for token the row a rollout makes of the same code."""
    from megatron_dapo.data.datasets import load_prompts
    from megatron_dapo.tiny.tool_base import FENCES, TRAIN_SPEC, style_response

    prompt = load_prompts(TRAIN_SPEC).prompts[0]
    q = prompt.messages[-1]["content"]
    code = f"{FENCES.code_open}print({q.rstrip('=')},end='')\n{FENCES.code_close}"
    scripts = {q: [code, f"Answer: {prompt.ground_truth}"]}
    engine = ToolEngine(ScriptedPolicy(scripts, FENCES), FENCES, TOK, python_print, eos_ids=[EOS])
    [[s]] = engine.generate([ids(q)], 1, SamplingParams())
    assert s.response_ids == ids(style_response(prompt, "tool")) + [EOS] and s.tool.statuses == ["ok"]


def python_print(code: str) -> Future:
    """print(EXPR,end='') of the tool base's blocks, evaluated (stands for the sandbox)."""
    fut: Future = Future()
    fut.set_result(ToolResult("ok", str(eval(code.strip().removeprefix("print(").removesuffix(",end='')"))), "", 0.1))
    return fut

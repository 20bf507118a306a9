"""Dynamic sampling on the stream (collect/streaming.py): stop at N, abort the rest, budgets, failures, monitors,
determinism; the rounds path (rollout.streaming=false) is bit-for-bit the pre-streaming code; the trainer
with streaming on (monitors, SIGKILL + resume replays exactly)."""

import hashlib
import logging
import math

import pytest
from support import TAGS, FailingEngine, kill_job_at, run_train, train_cmd

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingStats
from megatron_dapo.config import AlgoConfig, ConfigError, RewardConfig, load_config, validate
from megatron_dapo.data.arithmetic import make_arithmetic_prompts
from megatron_dapo.collect.result import StepRollout, StreamRollout
from megatron_dapo.collect.rounds import collect_rounds, surplus_tokens
from megatron_dapo.collect.scoring import rendered, score_group
from megatron_dapo.collect.seeds import seed_of
from megatron_dapo.collect.streaming import RolloutStepError, StreamPlan, stream_groups
from megatron_dapo.metrics import read_scalars
from megatron_dapo.reward.scorer import Scorer
from megatron_dapo.rollout import EmbeddedEngine, SamplingParams
from megatron_dapo.rollout.base import AbortReport, GroupRequest, GroupResult
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Group, Prompt, Sample

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2)


def source(informative=lambda g: g % 3 != 0, max_new=lambda g: 6 + (g % 4) * 10):
    """Group g: a prompt whose uid says whether its group is informative; lengths vary with g."""
    def request(g: int):
        prompt = Prompt(uid=f"t/{g}", messages=(), ground_truth=str(int(informative(g))))
        return prompt, GroupRequest(key=g, prompt_ids=[1 + g % 50, 2, 3], n=2, sampling=SamplingParams(
            max_new_tokens=max_new(g), ignore_eos=True, seed=seed_of(1, "train", 0, "group", g)))
    return request


def score(group: Group) -> None:
    """Informative groups: one right answer of two."""
    for k, s in enumerate(group.samples):
        s.acc = group.prompt.ground_truth == "1" and k == 0
        s.reward = 1.0 if s.acc else -1.0


def plan(**kw) -> StreamPlan:
    return StreamPlan(**{**dict(target_groups=4, first=4, max_inflight=8, max_groups=40), **kw})


def _offered(p: StreamPlan, informative: int, dull: int):
    """p's sampler after `informative` groups it keeps and `dull` ones it drops."""
    sampler = p.sampler()
    for k in range(informative + dull):
        group = Group(prompt=Prompt(uid=str(k), messages=(), ground_truth="1"),
                      samples=[Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1], finish_reason="stop",
                                      acc=k < informative and j == 0) for j in range(2)])
        sampler.offer(group)
    return sampler


def test_inflight_follows_the_kept_fraction():
    p = plan(oversample=1.5, max_inflight=100)
    assert p.inflight(_offered(p, 0, 0)) == 4  # first
    assert p.inflight(_offered(p, 1, 1)) == math.ceil(1.5 * 3 / (2 / 4))  # Laplace (1+1)/(2+2)
    assert p.inflight(_offered(p, 0, 50)) == math.ceil(1.5 * 4 / 0.1)  # floor 0.1
    assert plan().inflight(_offered(plan(), 0, 50)) == 8  # max_inflight
    algo = AlgoConfig(gen_batch_multiplier=1.5, max_gen_rounds=3)
    auto = StreamPlan.from_config(algo, target_groups=4)
    assert (auto.first, auto.max_inflight, auto.max_groups, auto.oversample) == (6, 12, 18, 1.5)
    off = StreamPlan.from_config(AlgoConfig(dynamic_sampling=False, gen_batch_multiplier=2.0), 4)
    assert (off.first, off.max_inflight, off.max_groups) == (4, 4, 4)


def test_stops_at_n_informative_and_aborts_the_rest(model):
    engine = EmbeddedEngine(model)
    out = stream_groups(engine, source(), score, plan())
    assert len(out.groups) == 4 and all(g.prompt.ground_truth == "1" for g in out.groups)
    assert out.stats.groups_kept == 4 and not out.stats.exhausted
    seen = len(out.generated)
    assert out.stats.groups_seen == seen and out.stats.kept_frac == 4 / seen
    s = out.stream
    assert s.submitted == seen + s.aborted_groups and s.aborted_groups > 0
    assert s.generated_tokens == sum(x.response_len for g in out.generated for x in g.samples) + s.wasted_tokens
    assert 0 < s.first_kept_s < 60
    again = stream_groups(EmbeddedEngine(model), source(), score, plan())  # the embedded stream is deterministic
    assert [g.prompt.uid for g in again.groups] == [g.prompt.uid for g in out.groups]
    assert again.stream == out.stream.__class__(**{**vars(out.stream), "first_kept_s": again.stream.first_kept_s})
    wide = stream_groups(EmbeddedEngine(model), source(), score, plan(max_inflight=20, first=10))
    same = {g.prompt.uid: g for g in wide.generated}
    for g in out.generated:  # a group is a function of its index, whatever ran beside it
        if g.prompt.uid in same:
            assert [x.response_ids for x in g.samples] == [x.response_ids for x in same[g.prompt.uid].samples]


def test_never_more_in_flight_than_allowed(model):
    engine = EmbeddedEngine(model)
    real = engine.stream
    peaks = []

    def stream():
        s = real()
        submit = s.submit

        def counted(reqs):
            submit(reqs)
            peaks.append(s.pending)
        s.submit = counted
        return s

    engine.stream = stream
    out = stream_groups(engine, source(), score, plan(max_inflight=5, first=3))
    assert peaks and max(peaks) <= 5 and peaks[0] == 3
    assert len(out.groups) == 4


def test_budget_exhausted(model, caplog):
    never = source(informative=lambda g: False)
    with caplog.at_level(logging.WARNING):
        out = stream_groups(EmbeddedEngine(model), never, score, plan(max_groups=7))
    assert out.groups == [] and out.stats.exhausted and out.stream.submitted == 7 and len(out.generated) == 7
    assert out.stats.rounds == 2 and "kept 0/4 informative groups after 7/7 streamed groups" in caplog.text
    with pytest.raises(RuntimeError, match="kept 0/4"):
        stream_groups(EmbeddedEngine(model), never, score, plan(max_groups=7, on_exhausted="error"))


def test_dynamic_sampling_off_runs_exactly_n(model):
    algo = AlgoConfig(dynamic_sampling=False, gen_batch_multiplier=3.0)
    out = stream_groups(EmbeddedEngine(model), source(informative=lambda g: False), score,
                        StreamPlan.from_config(algo, target_groups=5))
    assert len(out.groups) == 5 and out.stream.submitted == 5 and out.stream.aborted_groups == 0


def test_an_engine_failure_keeps_what_was_kept(model):
    from megatron_dapo.rollout.engine_group import EngineGroup

    group = EngineGroup([FailingEngine(good=2), EmbeddedEngine(model)], names=["http://dead:7", "embedded"])
    with pytest.raises(RolloutStepError) as err:
        stream_groups(group, source(informative=lambda g: True, max_new=lambda g: 40 if g % 2 else 1), score,
                      plan(target_groups=30, max_inflight=6, first=6))
    partial: StreamRollout = err.value.partial
    assert "http://dead:7" in str(err.value) and "connection refused" in str(err.value)
    assert f"after keeping {len(partial.groups)}/30 groups" in str(err.value)
    assert partial.groups and partial.groups == partial.generated  # all informative: every finished group kept
    assert partial.stream.aborted_groups == partial.stream.submitted - len(partial.generated)


class ScriptedEngine:
    """A stream that finishes groups in key order (two 3-token samples each) and, on abort, reports each
    pending group's samples so far from `so_far` (lengths; 0 = not started)."""

    def __init__(self, so_far=None):
        self.so_far, self.keys = so_far, []

    def stream(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @property
    def pending(self):
        return len(self.keys)

    def submit(self, requests):
        self.keys += [r.key for r in requests]

    def next(self):
        return GroupResult(key=self.keys.pop(0), samples=[sample(3, "stop") for _ in range(2)])

    def abort(self):
        keys, self.keys = sorted(self.keys), []
        partial = {k: [sample(n, "abort") for n in self.so_far[k]] for k in keys} if self.so_far else {}
        return AbortReport(keys=keys, tokens=sum(sum(self.so_far[k]) for k in keys) if self.so_far else 0,
                           partial=partial)


def sample(length, reason):
    return Sample(prompt_ids=[1], response_ids=[5] * length, rollout_logprobs=[0.0] * length,
                  finish_reason=reason)


def test_the_aborted_started_samples_mean_length_is_a_monitor():
    every = source(informative=lambda g: True)
    out = stream_groups(ScriptedEngine({2: [10, 0], 3: [6, 4]}), every, score, plan(target_groups=2))  # type: ignore[arg-type]  # a scripted stand-in
    assert len(out.groups) == 2 and out.stream.aborted_groups == 2 and out.stream.wasted_tokens == 20
    assert out.stream.aborted_response_len == 20 / 3  # 10, 6 and 4: the sample not started is left out
    assert out.cost()["rollout/aborted_response_len"] == 20 / 3
    blind = stream_groups(ScriptedEngine(), every, score, plan(target_groups=2))  # type: ignore[arg-type]  # no samples reported
    assert math.isnan(blind.stream.aborted_response_len)
    assert "rollout/aborted_response_len" not in blind.cost()


def test_rounds_monitors_count_the_trimmed_surplus():
    def group(uid, informative, length):
        samples = [Sample(prompt_ids=[1], response_ids=[5] * length, rollout_logprobs=[0.0] * length,
                          finish_reason="stop", acc=informative and k == 0) for k in range(2)]
        return Group(prompt=Prompt(uid=uid, messages=(), ground_truth="1"), samples=samples)

    kept, surplus, useless = group("a", True, 3), group("b", True, 5), group("c", False, 7)
    generated = [kept, surplus, useless]
    wasted = surplus_tokens(generated, [kept], AlgoConfig())
    rollout = StepRollout(groups=[kept], stats=DynamicSamplingStats(1, 3, 2, 2 / 3, False), generated=generated,
                          wasted_tokens=wasted)
    assert rollout.cost() == {
        "rollout/aborted_groups": 0.0, "rollout/wasted_tokens": 10.0, "rollout/generated_tokens": 30.0}
    assert surplus_tokens(generated, [kept], AlgoConfig(dynamic_sampling=False)) == 24


def test_rounds_path_is_bit_for_bit_the_pre_streaming_code():
    """collect_rounds (rollout.streaming=false) on a fixed model and seed: the token digest measured with the
    code before streaming existed (commit b445368), for both decoders."""
    from megatron_dapo.tiny.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for fast in (True, False):
        prompts = iter(make_arithmetic_prompts(100, seed=0))
        engine = EmbeddedEngine(tiny_model("qwen2", seed=0, vocab_size=len(tok)), fast_path=fast)
        scorer = Scorer(RewardConfig(overlong_cache_len=4), max_response_len=12)
        out = collect_rounds(engine, lambda: rendered(tok, next(prompts)), lambda g: score_group(g, tok, scorer),
                             lambda r: SamplingParams(max_new_tokens=12, stop_token_ids=(1,),
                                                      seed=seed_of(1, "train", 0, r)),
                             algo=AlgoConfig(group_size=4, max_gen_rounds=3), target_groups=3)
        h = hashlib.sha256()
        for g in out.generated:
            for s in g.samples:
                h.update(repr((g.prompt.uid, s.response_ids, s.finish_reason)).encode())
        assert (out.stats.rounds, len(out.generated)) == (3, 27)
        assert h.hexdigest() == "885176341038b44bb353d07470135b15ebf65cbaec132f30057f9fb91d7288b0"


def test_config_switches():
    cfg = load_config(None, ["rollout.streaming=true", "rollout.max_inflight_groups=12"])
    assert cfg.rollout.streaming and cfg.rollout.max_inflight_groups == 12
    cfg.rollout.max_inflight_groups = -1
    with pytest.raises(ConfigError, match="rollout.max_inflight_groups=-1"):
        validate(cfg)


STREAM = ["rollout.streaming=true", "rollout.max_inflight_groups=12", "algo.gen_batch_multiplier=1.5"]


def test_trainer_streams_and_writes_the_monitors(base_dir, tmp_path, python_env):
    run_train(train_cmd(base_dir, tmp_path, "stream", "train.steps=2", "checkpoint.save_every=0", *STREAM),
              python_env)
    tb = read_scalars(tmp_path / "tb" / "stream")
    for tag in TAGS + ["rollout/aborted_groups", "rollout/wasted_tokens", "rollout/generated_tokens"]:
        assert tag in tb and all(math.isfinite(v) for v in tb[tag].values()), tag
    assert set(tb["rollout/groups_trained"].values()) == {8.0}
    assert all(v > 0 for v in tb["rollout/generated_tokens"].values())


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["drop", "partial_rollout"])
def test_streaming_sigkill_and_resume_replays_exactly(base_dir, tmp_path, python_env, partial):
    """The embedded stream is one deterministic decode loop and group g's seed is f(seed, step, g): a
    resumed run replays the same groups, kept set included. With partial rollout the checkpoint holds the
    groups the step aborted, and the resumed run continues them as the straight run did."""
    extra = ["rollout.partial_rollout=true", "rollout.max_carry_steps=1"] if partial else []
    steps = ["train.steps=3", "checkpoint.save_every=1", "eval.every_steps=0", *STREAM, *extra]
    run_train(train_cmd(base_dir, tmp_path, "straight", *steps), python_env)
    marker = tmp_path / "ckpt" / "killed" / "step_00000001" / "COMPLETE"
    kill_job_at(train_cmd(base_dir, tmp_path, "killed", *steps), python_env, marker)
    assert marker.exists(), "the run never reached its step-1 checkpoint"
    run_train(train_cmd(base_dir, tmp_path, "killed", *steps, "checkpoint.resume=auto"), python_env)
    a, b = read_scalars(tmp_path / "tb" / "straight"), read_scalars(tmp_path / "tb" / "killed")
    carry = ["rollout/resumed_groups", "rollout/carried_groups", "rollout/carried_tokens",
             "rollout/dropped_stale_groups"] if partial else []
    if partial:
        assert a["rollout/resumed_groups"][2] == a["rollout/carried_groups"][1] > 0, a["rollout/carried_groups"]
    for tag in TAGS + ["rollout/aborted_groups", "rollout/wasted_tokens", "rollout/generated_tokens", *carry]:
        if tag.startswith(("timing/", "perf/", "val/")):
            continue
        for step in (2, 3):
            assert a[tag][step] == b[tag][step], (tag, step, a[tag][step], b[tag][step])

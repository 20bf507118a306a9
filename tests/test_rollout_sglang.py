"""SGLang rollout engine.

Default tier (no sglang, no venv): bucket splitting, /generate response parsing, the CPU shims, and failure
handling against a fake server process (dies at start, never healthy, killed mid-request, too slow,
refuses the weight-update group).

`-m sglang` tier: a REAL SGLang 0.5.23 server on CPU from the cached venv (tools/sglang_venv.sh), ONE
server for the module, float32 tiny Qwen2: generate + logprobs vs a teacher-forced transformers
forward, finish reasons, the three weight transports (tensor / gloo broadcast / disk) bringing the
logprobs to a second model's, sleep/wake/abort/health, and a kill -9 that must fail loudly.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from sglang_support import SGLANG_TIMEOUT, max_logprob_diff, process_gone, server_ports

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import EngineStateError, GenerationAborted, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerError
from megatron_dapo.rollout.sglang.wire import iter_buckets, parse_generate_response

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ pure logic (default)


def test_buckets_split_by_bytes_and_big_tensor_travels_alone():
    t = {
        n: torch.zeros(k, dtype=torch.float32)
        for n, k in [("a", 25), ("b", 25), ("big", 100), ("c", 10), ("d", 64)]
    }
    buckets = list(iter_buckets(t.items(), bucket_bytes=256))  # a, b: 100 B each; big: 400 B; c: 40; d: 256
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["big"], ["c"], ["d"]]
    assert all(sum(x.numel() * 4 for _, x in b) <= 256 or len(b) == 1 for b in buckets)


def test_buckets_consume_the_stream_lazily():
    seen = []

    def stream():
        for i in range(6):
            seen.append(i)
            yield f"w{i}", torch.zeros(16, dtype=torch.float32)  # 64 B

    it = iter_buckets(stream(), bucket_bytes=128)
    assert [n for n, _ in next(it)] == ["w0", "w1"]
    assert seen == [0, 1, 2]  # one tensor of look-ahead, never the whole model
    with pytest.raises(ValueError):
        list(iter_buckets(stream(), bucket_bytes=0))


def _item(ids, lps, reason):
    fr = (
        {"type": "length", "length": len(ids)} if reason == "length" else {"type": reason, "matched": ids[-1]}
    )
    return {
        "output_ids": ids,
        "meta_info": {
            "id": "x",
            "finish_reason": fr,
            "prompt_tokens": 3,
            "weight_version": "default",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        },
    }


def test_parse_generate_response_recorded_shape():
    payload = [_item([26, 15, 175], [-2.78, -3.76, -3.49], "length"), _item([8, 1], [-4.0, -5.5], "stop")]
    samples = parse_generate_response(payload, [[5, 6, 7], [9, 9]])
    assert [s.response_ids for s in samples] == [[26, 15, 175], [8, 1]]
    assert samples[0].rollout_logprobs == pytest.approx([-2.78, -3.76, -3.49])
    assert [s.finish_reason for s in samples] == ["length", "stop"]
    assert samples[0].truncated and not samples[1].truncated
    assert samples[1].prompt_ids == [9, 9]
    single = parse_generate_response(_item([3], [-1.0], "stop"), [[1]])  # a lone request: a dict
    assert single[0].response_ids == [3]


def test_parse_generate_response_rejects_abort_and_malformed():
    aborted = _item([1], [-1.0], "length")
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort all requests"}
    with pytest.raises(GenerationAborted):
        parse_generate_response([aborted], [[1]])
    with pytest.raises(ValueError, match="2 requests"):
        parse_generate_response([_item([1], [-1.0], "stop")], [[1], [2]])
    bad = _item([1, 2], [-1.0], "length")
    bad["meta_info"]["output_token_logprobs"] = bad["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(ValueError, match="request 0"):
        parse_generate_response([bad], [[1]])


# ------------------------------------------------------------- failure handling with a fake server

def test_server_that_exits_at_start_names_server_and_log(fake_python, tmp_path):
    with pytest.raises(SGLangServerError) as err:
        fake_python("exit", startup_timeout_s=60)
    msg = str(err.value)
    assert "exited with code 3 during startup" in msg and "http://127.0.0.1:" in msg
    assert str(tmp_path / "logs") in msg and "not enough memory for the KV cache" in msg  # the log's tail


def test_server_that_never_gets_healthy_times_out_and_is_killed(fake_python):
    t0 = time.monotonic()
    with pytest.raises(SGLangServerError, match="did not become healthy within 2 s") as err:
        fake_python("hang", startup_timeout_s=2)
    assert time.monotonic() - t0 < 30
    pid = int(str(err.value).split("(pid ")[1].split(")")[0])
    assert process_gone(pid)


def test_server_whose_port_was_taken_fails_fast_not_at_the_timeout(fake_python):
    t0 = time.monotonic()
    with pytest.raises(SGLangServerError, match="failed to start .*address already in use.*; killed it") as err:
        fake_python("bindfail", startup_timeout_s=600)
    assert time.monotonic() - t0 < 30
    pid = int(str(err.value).split("(pid ")[1].split(")")[0])
    assert process_gone(pid)


def test_killed_server_fails_the_running_request_fast(fake_python):
    engine = fake_python("serve", startup_timeout_s=60, request_timeout_s=600)
    try:
        assert engine.health()
        threading.Timer(0.5, os.kill, (engine.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(SGLangServerError) as err:
            engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=4))
        assert time.monotonic() - t0 < 15  # not the 600 s request timeout
        msg = str(err.value)
        assert f"(pid {engine.pid}) exited with code -9 while serving POST /generate" in msg
        assert str(engine.log_path) in msg and "fake sglang starting" in msg
        assert not engine.health()
    finally:
        engine.shutdown()


def test_slow_server_hits_the_request_timeout(fake_python):
    engine = fake_python("serve", startup_timeout_s=60, request_timeout_s=1)
    try:
        with pytest.raises(SGLangServerError, match="did not answer POST /generate within 1 s"):
            engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=4))
    finally:
        pid = engine.pid
        engine.shutdown()
        assert process_gone(pid)
        engine.shutdown()  # idempotent


def test_server_refusing_the_weight_group_fails_fast(fake_python):
    """The trainer joins the broadcast group alongside the HTTP call; a refusal must not leave it
    waiting for the group's 600 s rendezvous timeout."""
    engine = fake_python("serve", startup_timeout_s=60, request_timeout_s=600)
    try:
        t0 = time.monotonic()
        with pytest.raises(SGLangServerError, match="boom"):
            engine.update_weights([("w", torch.zeros(4))], transport="distributed")
        assert time.monotonic() - t0 < 15
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- the real SGLang server

@pytest.fixture(scope="module")
def engine(sglang_python, models, tmp_path_factory):
    """ONE real server for the module (start ~20-70 s on 2 cores); stopped by PID at the end."""
    log_dir = tmp_path_factory.mktemp("sglang-logs")
    t0 = time.monotonic()
    eng = SGLangEngine(
        models["a"],
        SGLangConfig(startup_timeout_s=600, request_timeout_s=300),
        python=sglang_python,
        port=server_ports(),
        dtype="float32",
        max_total_tokens=8192,
        log_dir=log_dir,
        bucket_mb=1,
    )
    print(f"\nSGLang server {eng.url} pid {eng.pid} up in {time.monotonic() - t0:.1f} s; log {eng.log_path}")
    pid = eng.pid
    yield eng
    eng.shutdown()
    assert process_gone(pid), f"SGLang server pid {pid} still running after shutdown()"


PROMPTS = [[5, 6, 7], [9, 9], [17, 33, 65, 129, 200]]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_generate_n_samples_with_logprobs_equal_to_teacher_forcing(engine, hf):
    """temperature 1.0: SGLang reports log softmax(logits / T) of the sampled token == the HF forward."""
    groups = engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True))
    assert [len(g) for g in groups] == [4, 4, 4]
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert s.prompt_ids == prompt
            assert len(s.response_ids) == len(s.rollout_logprobs) == 12
            assert s.finish_reason == "length" and s.truncated
            assert all(lp <= 0 for lp in s.rollout_logprobs)
    assert len({tuple(s.response_ids) for s in groups[0]}) > 1  # the n samples are sampled independently
    assert max_logprob_diff(hf["a"], groups) <= 1e-4


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_finish_reasons_stop_and_length(engine, hf):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    first = engine.generate([PROMPTS[0]], 1, greedy)[0][0]
    assert first.finish_reason == "length" and len(first.response_ids) == 5
    assert first.response_ids[0] == int(hf["a"](input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
    stop_tok = first.response_ids[2]
    stopped = engine.generate(
        [PROMPTS[0]],
        1,
        SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True, stop_token_ids=(stop_tok,)),
    )[0][0]
    cut = first.response_ids.index(stop_tok) + 1
    assert stopped.finish_reason == "stop" and not stopped.truncated
    assert stopped.response_ids == first.response_ids[:cut]  # the stop token is kept, with its logprob
    assert stopped.rollout_logprobs == pytest.approx(first.rollout_logprobs[:cut], abs=1e-5)
    # without ignore_eos the stop ids go to SGLang itself; the model's EOS (1) stops too
    plain = engine.generate(
        [PROMPTS[0]], 1, SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(stop_tok,))
    )[0][0]
    eos_cut = min(first.response_ids.index(t) + 1 for t in (stop_tok, 1) if t in first.response_ids)
    assert plain.response_ids == first.response_ids[:eos_cut] and plain.finish_reason == "stop"
    seeded = engine.generate([PROMPTS[0]], 2, SamplingParams(max_new_tokens=3, ignore_eos=True, seed=7))
    assert [len(s.response_ids) for s in seeded[0]] == [3, 3]  # per-request sampling_seed accepted


@pytest.mark.sglang
@SGLANG_TIMEOUT
@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_weight_update_makes_logprobs_match_the_new_model(engine, hf, transport):
    """Sync model b into the server in 64 KiB buckets (8 per model), check its logprobs, sync a back."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    engine.bucket_bytes = 64 * 1024  # embed / lm_head (64 KiB each) alone, the rest grouped
    try:
        for target in ("b", "a"):
            before = engine.weight_version()
            engine.update_weights(hf[target].state_dict().items(), transport=transport)
            stats = engine.last_update
            print(
                f"\n{transport} -> {target}: {stats.seconds * 1e3:.1f} ms, {stats.bytes} B, "
                f"{stats.tensors} tensors in {stats.buckets} buckets"
            )
            total = sum(t.numel() * 4 for t in hf[target].state_dict().values())
            assert stats.buckets > 3 and stats.bytes == total
            assert engine.weight_version() != before
            groups = engine.generate(PROMPTS, 2, sampling)
            assert max_logprob_diff(hf[target], groups) <= 1e-4
        assert max_logprob_diff(hf["b"], groups) > 1e-2  # the check can tell the two models apart
    finally:
        engine.bucket_bytes = 2**20


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_weight_update_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="model.nope"):
        engine.update_weights([("model.nope", torch.zeros(2))], transport="tensor")
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], transport="disk")
    assert engine.health()


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_score_is_teacher_forced_logprobs(engine, hf):
    """The weight-sync probe's engine side: input-token logprobs at T=1 == the HF forward's."""
    from sglang_support import _teacher_forced

    tokens = [5, 6, 7, 17, 33, 65, 129, 200, 3, 9]
    (scored,) = engine.score(tokens, 4)
    assert len(scored) == 6
    assert (torch.tensor(scored) - _teacher_forced(hf["a"], tokens[:4], tokens[4:])).abs().max() <= 1e-4


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_released_weights_are_lost_until_synced_again(engine, hf):
    """The CPU shim loses a released region as CUDA's memory saver does (no --enable-weights-cpu-backup):
    after sleep + wake the weights are NaN, updates into released weights are refused, and a full weight
    update brings the model back exactly."""
    tokens = [5, 6, 7, 17, 33, 65, 129, 200]
    engine.sleep()
    with pytest.raises(EngineStateError, match="released"):
        engine.update_weights(hf["a"].state_dict().items(), transport="tensor")
    engine.wake()
    assert all(math.isnan(x) for x in engine.score(tokens, 4)[0])
    engine.update_weights(hf["a"].state_dict().items(), transport="tensor")
    groups = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True))
    assert max_logprob_diff(hf["a"], groups) <= 1e-4


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_an_idle_server_takes_no_cpu(engine):
    """Without --sleep-on-idle the scheduler polls in a loop and takes a whole core while the trainer works."""
    import psutil

    procs = [psutil.Process(engine.pid), *psutil.Process(engine.pid).children(recursive=True)]
    assert engine.health()
    time.sleep(2.0)  # the health request's work is done

    def busy() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())

    before, t0 = busy(), time.monotonic()
    time.sleep(4.0)
    share = (busy() - before) / (time.monotonic() - t0)
    assert share < 0.25, f"the idle server's processes took {share:.0%} of a core"


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_sleep_wake_abort_health(engine, hf):
    assert engine.health()
    engine.sleep()
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    engine.wake()
    engine.update_weights(hf["a"].state_dict().items(), transport="tensor")  # released weights are lost
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))[0][0].response_ids

    box: dict = {}

    def long_generation():
        try:
            box["out"] = engine.generate(PROMPTS * 4, 2, SamplingParams(max_new_tokens=900, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    engine.abort()
    worker.join(60)
    assert not worker.is_alive(), "generate did not return after abort()"
    assert isinstance(box.get("err"), GenerationAborted), box
    assert time.monotonic() - t0 < 30
    assert engine.health()
    again = engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(again[0][0].response_ids) == 3


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_zz_killed_server_gives_a_clear_error_not_a_hang(engine):
    """Runs last (it kills the module's server): kill -9, then calls fail fast naming server and log."""
    os.kill(engine.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(SGLangServerError) as err:
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=4))
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert engine.url in msg and f"pid {engine.pid}" in msg and str(engine.log_path) in msg
    assert "--- last lines of" in msg
    assert not engine.health()

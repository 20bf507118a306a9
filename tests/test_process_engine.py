"""The embedded engine in a process of its own (rollout/embedded/process_engine.py), what off-policy pipelining runs:
exactly the in-process engine's samples and logprobs (batched, streamed, aborted with partial samples, after
weight updates), its errors with their types, a dead child named instead of a hang, and a child that is
always reaped."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from support import abort_a_running_generate

from megatron_dapo.rollout.base import (
    EngineStateError,
    GenerationAborted,
    GroupRequest,
    NonFiniteLogitsError,
    SamplingParams,
)
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.embedded.process_engine import EngineProcessError, ProcessEngine
from megatron_dapo.rollout.restarts import EngineLostError, Restarts

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=7)


@pytest.fixture(scope="module")
def hf_dir(tiny_hf):
    return tiny_hf("qwen2", vocab_size=100, seed=3)


@pytest.fixture(scope="module")
def engines(hf_dir, one_thread):
    """The same model in this process and in a child, both on one thread."""
    local = EmbeddedEngine(hf_dir)
    remote = ProcessEngine(hf_dir, threads=1, bucket_mb=1)  # a small buffer: several buckets a sync
    yield local, remote
    remote.shutdown()
    local.shutdown()


def requests(seed: int) -> list[GroupRequest]:
    return [GroupRequest(key=k, prompt_ids=p, n=3, sampling=SamplingParams(
        temperature=1.0, max_new_tokens=10 + 3 * k, seed=seed + k)) for k, p in enumerate(PROMPTS)]


def streamed(engine, seed: int) -> dict:
    with engine.stream() as stream:
        stream.submit(requests(seed))
        assert stream.pending == len(PROMPTS)
        out = {}
        while stream.pending:
            r = stream.next()
            out[r.key] = r.samples
    return out


def test_batched_and_streamed_samples_are_the_in_process_engines(engines):
    local, remote = engines
    assert remote.info["threads"] == 1 and remote.health()
    assert remote.generate(PROMPTS, 2, SAMPLING) == local.generate(PROMPTS, 2, SAMPLING)
    assert streamed(remote, 11) == streamed(local, 11)


def test_an_aborted_stream_reports_the_same_partial_samples(engines):
    """Partial rollout: after the first finished group, abort; the report (keys, tokens, partial samples)
    is the in-process engine's, and resuming from it gives the same continuations."""
    reports, resumed = [], []
    for engine in engines:
        with engine.stream() as stream:
            stream.submit(requests(21))
            first = stream.next()
            report = stream.abort()
            assert stream.pending == 0
            reports.append((first, report))
            stream.submit([GroupRequest(key=k, prompt_ids=PROMPTS[k], n=3, sampling=requests(21)[k].sampling,
                                        resume=tuple(report.partial[k])) for k in report.keys])
            resumed.append(sorted((r.key, r.samples) for r in (stream.next() for _ in report.keys)))
    assert reports[0] == reports[1] and reports[0][1].partial
    assert resumed[0] == resumed[1]


def test_after_update_weights_the_samples_are_still_the_same(engines):
    """Weights go through the shared buffer in several buckets and are copied, not aliased: changing the
    source tensors afterwards changes nothing in the child."""
    local, remote = engines
    torch.manual_seed(0)
    new = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in local.model.named_parameters()}
    before = remote.generate(PROMPTS, 2, SAMPLING)
    remote.update_weights(new.items())
    local.update_weights(new.items())
    after = remote.generate(PROMPTS, 2, SAMPLING)
    assert after != before and after == local.generate(PROMPTS, 2, SAMPLING)
    for t in new.values():
        t.zero_()  # the actor's parameters change under a pipelined engine
    assert remote.generate(PROMPTS, 2, SAMPLING) == after
    assert streamed(remote, 31) == streamed(local, 31)
    assert remote.score([1, 2, 3, 4, 5], 2) == local.score([1, 2, 3, 4, 5], 2)


def test_errors_in_the_child_are_raised_here_with_their_type(engines):
    local, remote = engines
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        remote.generate([[1], []], 1, SAMPLING)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 100\)"):
        remote.generate([[1, 500]], 1, SAMPLING)
    with pytest.raises(KeyError, match="unknown parameter 'model.nope'") as err:
        remote.update_weights([("model.nope", torch.zeros(2))])
    assert any("raised in the engine process" in note for note in err.value.__notes__)
    name = next(iter(local.model.state_dict()))
    with pytest.raises(ValueError, match="got shape"):
        remote.update_weights([(name, torch.zeros(3, 3))])
    with remote.stream() as stream:
        stream.submit(requests(1)[:1])
        with pytest.raises(ValueError, match="already pending"):
            stream.submit(requests(1)[:1])
        assert stream.pending == 1
    assert remote.generate(PROMPTS, 1, SAMPLING) == local.generate(PROMPTS, 1, SAMPLING)  # still serving


def test_non_finite_weights_raise_non_finite_logits_error(hf_dir):
    with ProcessEngine(hf_dir, threads=1) as engine:
        name = "lm_head.weight"
        shapes = {n: p.shape for n, p in EmbeddedEngine(hf_dir).model.named_parameters()}
        engine.update_weights([(name, torch.full(shapes[name], float("nan")))])
        with pytest.raises(NonFiniteLogitsError):
            engine.generate(PROMPTS, 1, SAMPLING)
        with engine.stream() as stream:
            stream.submit(requests(1))
            with pytest.raises(NonFiniteLogitsError):
                stream.next()
        engine.abort()  # nothing running: a no-op, as in process
        assert engine.health()


def test_abort_from_another_thread_stops_a_running_generate(hf_dir):
    engine = ProcessEngine(hf_dir, threads=1)
    try:
        errors = abort_a_running_generate(engine, PROMPTS, limit_s=60, poll_s=0.2)
        assert len(errors) == 1 and isinstance(errors[0], GenerationAborted)
        assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0].response_len == 3
    finally:
        engine.shutdown()


def test_resident_bytes_answers_while_a_generation_runs(hf_dir):
    """The phases' ledger asks at the actor's train phase, while the pipeline's producer generates the next
    batch: the answer comes on the control channel, not after the generation."""
    engine = ProcessEngine(hf_dir, threads=1)
    done, answer = threading.Event(), []

    def run() -> None:
        try:
            engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=0))
        except GenerationAborted:
            pass
        finally:
            done.set()

    try:
        threading.Thread(target=run, daemon=True).start()
        deadline = time.monotonic() + 60
        while not engine._cmd_lock.locked() and time.monotonic() < deadline:  # the generation holds the channel
            time.sleep(0.01)
        asker = threading.Thread(target=lambda: answer.append(engine.resident_bytes()), daemon=True)
        asker.start()
        asker.join(timeout=60)
        assert answer and not done.is_set(), "resident_bytes waited for the generation"
        local = EmbeddedEngine(hf_dir)
        assert answer[0] == local.resident_bytes() and answer[0]["weights"] > 0
        local.shutdown()
    finally:
        while not done.wait(0.2):
            engine.abort()
        engine.shutdown()


def test_a_dead_child_is_an_error_naming_it_not_a_hang(hf_dir):
    engine = ProcessEngine(hf_dir, threads=1)
    try:
        os.kill(engine.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineProcessError, match=rf"engine process \(pid {engine.pid}\) died during generate "
                                                     rf"\(exit code -9\)"):
            engine.generate(PROMPTS, 1, SAMPLING)
        assert time.monotonic() - t0 < 30
        assert not engine.health()
        with pytest.raises(EngineProcessError, match="died"):
            engine.stream()
        with pytest.raises(EngineProcessError, match="died"):
            engine.update_weights([("lm_head.weight", torch.zeros(1))])
    finally:
        engine.shutdown()
    engine.shutdown()  # idempotent


def test_a_child_killed_mid_generation_is_detected(hf_dir):
    engine = ProcessEngine(hf_dir, threads=1)
    try:
        threading.Timer(3.0, os.kill, (engine.pid, signal.SIGKILL)).start()
        with pytest.raises(EngineProcessError, match="died during generate"):
            engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=0))
    finally:
        engine.shutdown()


def test_shutdown_reaps_the_child_also_when_the_caller_raises(hf_dir):
    with pytest.raises(RuntimeError, match="the trainer failed"), ProcessEngine(hf_dir, threads=1) as engine:
        proc = engine._proc
        assert proc.is_alive()
        raise RuntimeError("the trainer failed")
    assert not proc.is_alive() and proc.exitcode == 0
    assert not engine.health()
    with pytest.raises(EngineStateError, match="shut down"):
        engine.generate(PROMPTS, 1, SAMPLING)


def test_a_bad_model_folder_fails_start_up_with_its_error(tmp_path):
    with pytest.raises(OSError):
        ProcessEngine(tmp_path / "missing", threads=1, startup_timeout_s=300)


def test_shutdown_stops_a_stream_running_in_another_thread_and_sigterm_does_not(hf_dir):
    """The run's close with a batch in production (the producer thread in a stream's next()): the stream
    fails at once with EngineStateError, as in process. A SIGTERM to the job's process group is the
    trainer's to handle: the engine keeps serving."""
    engine = ProcessEngine(hf_dir, threads=1)
    os.kill(engine.pid, signal.SIGTERM)
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0].response_len == 3
    errors: list[BaseException] = []
    started = threading.Event()

    def produce() -> None:
        try:
            with engine.stream() as stream:
                stream.submit([GroupRequest(key=0, prompt_ids=[1, 2], n=2, sampling=SamplingParams(
                    max_new_tokens=100_000, ignore_eos=True, seed=0))])
                started.set()
                stream.next()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=produce)
    thread.start()
    assert started.wait(60)
    time.sleep(1.0)
    t0 = time.monotonic()
    engine.shutdown()
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - t0 < 30
    assert len(errors) == 1 and type(errors[0]) is EngineStateError, errors
    assert "EmbeddedEngine was shut down" in str(errors[0])
    assert not engine._proc.is_alive()


def test_an_error_that_cannot_cross_the_pipe_arrives_as_a_runtime_error_naming_it():
    """The parent rebuilds the child's exception from its pickle; one whose constructor the rebuild cannot
    call (two required arguments, one passed to super) or that does not pickle becomes a RuntimeError."""
    import threading

    from megatron_dapo.rollout.base import NonFiniteLogitsError
    from megatron_dapo.rollout.embedded.process_worker import portable

    keeps = NonFiniteLogitsError("nan at step 3")
    assert portable(keeps) is keeps
    for bad in (TwoArgs("x", "y"), ValueError(threading.Lock())):  # rebuilds as TwoArgs("x"); no pickle
        out = portable(bad)
        assert type(out) is RuntimeError and type(bad).__name__ in str(out)


class TwoArgs(Exception):
    """Pickles (a module-level class), but its rebuild calls TwoArgs("x"): a TypeError."""

    def __init__(self, a, b):
        super().__init__(a)



def test_a_child_killed_mid_stream_is_restarted_with_the_weights_and_its_groups(hf_dir):
    """rollout.sglang.max_restarts for the process engine: SIGKILL between two groups of a stream; the rest come
    from a new child that holds the last update's weights, the same as from an undisturbed engine; past the
    budget, one line naming the process and its exit status."""
    local, restarts = EmbeddedEngine(hf_dir), Restarts(max_restarts=1)
    remote = ProcessEngine(hf_dir, threads=1, restarts=restarts)
    try:
        torch.manual_seed(1)
        new = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in local.model.named_parameters()}
        for engine in (local, remote):
            engine.update_weights(new.items())
        want = streamed(local, 41)
        with remote.stream() as stream:
            stream.submit(requests(41))
            got = {(r := stream.next()).key: r.samples}
            first = remote.pid
            os.kill(first, signal.SIGKILL)
            while stream.pending:
                r = stream.next()
                got[r.key] = r.samples
        assert remote.pid != first and restarts.scalars() == {"rollout/engine_restarts": 1.0,
                                                                "rollout/resubmitted_groups": 2.0}
        assert {k: [s.response_ids for s in v] for k, v in got.items()} == {
            k: [s.response_ids for s in v] for k, v in want.items()}
        os.kill(remote.pid, signal.SIGKILL)
        with pytest.raises(EngineLostError, match=rf"rollout engine process engine \(pid {remote.pid}\): the engine "
                                                  r"process .* died during generate \(exit code -9\), after 1 restart"):
            remote.generate(PROMPTS, 1, SAMPLING)
    finally:
        remote.shutdown()

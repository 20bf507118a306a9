"""SGLang memory release/resume by tags (weights, kv_cache), as the sync phase uses them: the requests the
engine sends, the fallback to a whole resume when a server refuses tags, the wait for an idle server before a
release (SGLang's scheduler dies on a release while it serves), and (`sglang` tier) the real server: weights
resumed alone take a weight update, then the KV cache comes back and generation works; a release sent while a
request runs leaves the server serving."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import EngineStateError, GenerationAborted, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerError
from sglang_support import SGLANG_TIMEOUT, server_ports


class ScriptedServer:
    """What the engine's HTTP calls meet instead of a server: POSTs are recorded and answered; /v1/loads reports
    `running` requests (one fewer per report: they drain); /release_memory_occupation while any runs fails as
    SGLang's does (sglang 0.5.23 weight_updater.py asserts `is_fully_idle()`, and the scheduler dies)."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine, self.refuse_tags, self.running, self.dead = engine, False, 0, False
        self.calls: list[tuple[str, Any]] = []

    def __call__(self, method, path, body=None, *, timeout=None):
        if self.dead:
            raise self.engine._error(f"exited with code 1 while serving {method} {path}")
        if method == "GET":
            assert path.startswith("/v1/loads")
            report = {"loads": [{"dp_rank": 0, "num_running_reqs": self.running, "num_waiting_reqs": 0}]}
            self.running = max(self.running - 1, 0)
            return report
        self.calls.append((path, body))
        if path == "/release_memory_occupation" and self.running:
            self.dead = True
            raise self.engine._error("AssertionError: release_memory_occupation should be called only when server "
                                     "is idle.")
        if self.refuse_tags and body:
            raise self.engine._error(f"answered POST {path} with HTTP 400: tags unsupported")
        return {}


@pytest.fixture
def scripted(tiny_hf, monkeypatch):
    """An SGLangEngine attached to nothing: its HTTP calls go to a `ScriptedServer`."""
    engine = SGLangEngine(tiny_hf("qwen2"), SGLangConfig(), attach=True, wait=False, port=server_ports())
    server = ScriptedServer(engine)
    monkeypatch.setattr(engine, "call", server)
    monkeypatch.setattr(engine, "IDLE_POLL_S", 0.0)
    return engine, server


def test_sync_phase_requests(scripted):
    engine, server = scripted
    calls = server.calls
    engine.sleep()  # train: everything goes
    engine.wake(["weights"])  # sync: the weights only...
    assert engine.asleep and not engine.weights_released
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    engine.wake()  # ...then the rest (the KV cache and SGLang's CUDA graphs)
    assert not engine.asleep
    assert calls == [("/release_memory_occupation", {}),
                     ("/resume_memory_occupation", {"tags": ["weights"]}),
                     ("/resume_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]})]
    calls.clear()
    engine.sleep(["kv_cache"])
    engine.wake()
    assert calls == [("/release_memory_occupation", {"tags": ["kv_cache"]}),
                     ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    calls.clear()
    engine.sleep()
    engine.wake()  # everything released together comes back in one untagged call
    assert calls == [("/release_memory_occupation", {}), ("/resume_memory_occupation", {})]


def test_a_server_without_tags_gets_whole_resumes(scripted):
    engine, server = scripted
    calls = server.calls
    server.refuse_tags = True
    engine.sleep()
    engine.wake(["weights"])  # refused: one whole resume instead, the KV cache comes back with the weights
    assert not engine.asleep
    engine.sleep(["kv_cache"])  # from now on whole releases only
    assert calls[1:] == [("/resume_memory_occupation", {"tags": ["weights"]}), ("/resume_memory_occupation", {}),
                         ("/release_memory_occupation", {})]
    assert engine.weights_released


def test_a_dead_server_is_not_retried(scripted, monkeypatch):
    engine, server = scripted
    server.refuse_tags = True
    engine.sleep()
    monkeypatch.setattr(engine, "dead_reason", lambda: "exited with code 1")
    with pytest.raises(SGLangServerError):
        engine.wake(["weights"])


def test_sleep_waits_until_the_aborted_requests_drain(scripted):
    """After a stream's abort() stopped waiting, requests still run: the release waits for an idle report."""
    engine, server = scripted
    server.running = 3
    engine.sleep()
    assert server.calls == [("/release_memory_occupation", {})] and not server.dead
    assert engine.asleep


def test_sleep_aborts_stragglers_again_and_refuses_to_release_a_busy_server(scripted, monkeypatch):
    engine, server = scripted
    server.running = 10**6
    monkeypatch.setattr(engine, "REABORT_S", 0.0)
    with pytest.raises(EngineStateError, match="still has .* request"):
        engine.wait_idle(timeout_s=0.05)
    assert server.calls and all(c == ("/abort_request", {"abort_all": True}) for c in server.calls)
    assert not server.dead and not engine.asleep


def test_a_server_without_a_load_report_is_not_waited_for(scripted, monkeypatch):
    engine, server = scripted
    monkeypatch.setattr(engine, "call", lambda method, path, body=None, *, timeout=None:
                        server(method, path, body) if method == "POST" else None)  # /v1/loads unknown: no JSON
    engine.sleep()
    assert server.calls == [("/release_memory_occupation", {})]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_real_server_weights_then_kv_and_a_sleep_while_it_still_serves(sglang_python, models, hf, tmp_path):
    """One real server: a whole release, the weights woken alone take a sync, then the KV cache; and a release sent
    while a request runs (it killed SGLang's scheduler; sleep() now waits for it, or aborts it)."""
    import threading

    engine = SGLangEngine(models["a"], SGLangConfig(startup_timeout_s=600, request_timeout_s=300),
                          python=sglang_python, port=server_ports(), dtype="float32", max_total_tokens=8192,
                          log_dir=tmp_path, bucket_mb=1)
    try:
        sizes = engine.resident_bytes()
        engine.sleep()
        assert engine.resident_bytes() == {k: 0 for k in sizes}
        engine.wake(["weights"])
        assert engine._tags_ok  # SGLang 0.5.x takes the tags
        named = [(n, p.detach().clone()) for n, p in hf["b"].named_parameters()]
        t0 = time.monotonic()
        engine.update_weights(named, transport="tensor")
        engine.wake()
        out = engine.generate([[5, 6, 7]], 1, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        sample = out[0][0]
        ids = torch.tensor([[5, 6, 7] + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf["b"](ids).logits[0, 2:-1].float(), -1)
        want = logp.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(sample.rollout_logprobs), want, atol=1e-3), time.monotonic() - t0

        done = threading.Event()

        def generate() -> None:
            try:
                engine.generate([[5, 6, 7]] * 8, 1, SamplingParams(max_new_tokens=1000, ignore_eos=True))
            except GenerationAborted:
                pass  # sleep() aborted it: what it may do with a request still running
            finally:
                done.set()

        threading.Thread(target=generate, daemon=True).start()
        deadline = time.monotonic() + 60
        while not engine._busy_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._busy_requests(), "the generation never showed in the load report"
        engine.sleep()  # before: AssertionError in the scheduler, which died
        assert done.wait(60) and engine.dead_reason() is None
        engine.wake(["weights"])  # released weights are lost (the CPU shim): the scheduler takes a sync, then serves
        engine.update_weights([(n, p.detach().clone()) for n, p in hf["a"].named_parameters()], transport="tensor")
        engine.wake()
        assert engine.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=4))[0][0].response_ids
    finally:
        engine.shutdown()

"""SGLang memory release/resume by tags (weights, kv_cache), as the sync phase uses them: the requests the
engine sends, the fallback to a whole resume when a server refuses tags, and (`sglang` tier) the real
server: weights resumed alone take a weight update, then the KV cache comes back and generation works."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import EngineStateError, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerError
from sglang_support import SGLANG_TIMEOUT, server_ports


@pytest.fixture
def offline(tiny_hf, monkeypatch):
    """An SGLangEngine attached to nothing: its HTTP calls are recorded (and answered) here."""
    engine = SGLangEngine(tiny_hf("qwen2"), SGLangConfig(), attach=True, wait=False, port=server_ports())
    calls: list[tuple[str, object]] = []
    refuse = {"tags": False}

    def post(path, body=None, *, timeout=None):
        calls.append((path, body))
        if refuse["tags"] and body:
            raise engine._error(f"answered POST {path} with HTTP 400: tags unsupported")
        return {}

    monkeypatch.setattr(engine, "post", post)
    return engine, calls, refuse


def test_sync_phase_requests(offline):
    engine, calls, _ = offline
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


def test_a_server_without_tags_gets_whole_resumes(offline):
    engine, calls, refuse = offline
    refuse["tags"] = True
    engine.sleep()
    engine.wake(["weights"])  # refused: one whole resume instead, the KV cache comes back with the weights
    assert not engine.asleep
    engine.sleep(["kv_cache"])  # from now on whole releases only
    assert calls[1:] == [("/resume_memory_occupation", {"tags": ["weights"]}), ("/resume_memory_occupation", {}),
                         ("/release_memory_occupation", {})]
    assert engine.weights_released


def test_a_dead_server_is_not_retried(offline, monkeypatch):
    engine, _, refuse = offline
    refuse["tags"] = True
    engine.sleep()
    monkeypatch.setattr(engine, "dead_reason", lambda: "exited with code 1")
    with pytest.raises(SGLangServerError):
        engine.wake(["weights"])


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_real_server_weights_then_kv(sglang_python, models, hf, tmp_path):
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
    finally:
        engine.shutdown()

"""Several SGLang servers (rollout.sglang.num_servers, one per rollout TP group) behind one engine.

Default tier: launching against the fake server (ports, shutdown, a server that cannot start stops
the others). `-m sglang`: two REAL servers on CPU: prompts split across them give the same samples
and teacher-forced logprobs as one model, and a weight update reaches both.
"""

from __future__ import annotations

import socket
import time

import pytest
from sglang_support import SGLANG_TIMEOUT, _gone, _max_logprob_diff

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang_engine import SGLangEngine, SGLangServerError, free_port
from megatron_dapo.rollout.sglang_launch import launch_servers


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_one_server_is_a_plain_engine(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    engine = launch_servers(tmp_path, SGLangConfig(base_port=free_port()), python=str(fake_exe), device="cpu",
                            log_dir=tmp_path / "logs", shutdown_grace_s=2)
    try:
        assert isinstance(engine, SGLangEngine) and engine.health()
    finally:
        engine.shutdown()


def test_servers_take_consecutive_ports_and_stop_together(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    port = _two_free_ports()
    group = launch_servers(tmp_path, SGLangConfig(base_port=port, num_servers=2), python=str(fake_exe),
                           device="cpu", log_dir=tmp_path / "logs", shutdown_grace_s=2)
    assert isinstance(group, EngineGroup)
    assert group.names == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    pids = [e.pid for e in group.engines]
    assert group.health()
    group.shutdown()
    assert all(_gone(pid) for pid in pids)


def test_a_server_that_cannot_start_stops_the_others(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    port = _two_free_ports()
    spawned: list[SGLangEngine] = []
    original = SGLangEngine._start

    def start(self):
        spawned.append(self)
        original(self)

    monkeypatch.setattr(SGLangEngine, "_start", start)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(SGLangServerError, match=f"127.0.0.1:{port + 1}: the port is already in use"):
            launch_servers(tmp_path, SGLangConfig(base_port=port, num_servers=2), python=str(fake_exe),
                           device="cpu", log_dir=tmp_path / "logs", shutdown_grace_s=2)
    assert spawned and spawned[0].pid is not None and _gone(spawned[0].pid)


PROMPTS = [[5, 6, 7], [9, 9], [17, 33, 65, 129, 200], [40, 41], [3]]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_two_real_servers_split_prompts_and_both_take_weight_updates(sglang_python, models, hf, tmp_path):
    t0 = time.monotonic()
    group = launch_servers(models["a"], SGLangConfig(base_port=_two_free_ports(), num_servers=2,
                                                     startup_timeout_s=600, request_timeout_s=300),
                           python=sglang_python, dtype="float32", max_total_tokens=8192,
                           log_dir=tmp_path / "logs", bucket_mb=1)
    print(f"\ntwo SGLang servers up in {time.monotonic() - t0:.1f} s: {group.names}")
    pids = [e.pid for e in group.engines]
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        groups = group.generate(PROMPTS, 2, greedy)
        assert [s.prompt_ids for g in groups for s in g] == [list(p) for p in PROMPTS for _ in range(2)]
        assert _max_logprob_diff(hf["a"], groups) < 1e-4
        group.update_weights(hf["b"].state_dict().items())  # streamed to both servers at once
        sampled = group.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        per_server = [sampled[:3], sampled[3:]]  # prompts 0-2 went to server 0, 3-4 to server 1
        assert all(_max_logprob_diff(hf["b"], part) < 1e-4 for part in per_server)
    finally:
        group.shutdown()
    assert all(_gone(pid) for pid in pids)

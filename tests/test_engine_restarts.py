"""Restarting a lost rollout engine mid-run (rollout/restarts.py, engine_group.py, group_stream.py): scripted
engines whose samples are a function of their request (prompt, seed), so the groups a run receives can be
checked against what one undisturbed engine gives; and a fake SGLang server that is hung (SIGSTOP), noticed by
its health check, stopped for good and started again."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
from scripted_engines import N, Scripted, drain, expected, request
from sglang_support import process_gone, server_ports

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.restarts import EngineLostError, Restarts
from megatron_dapo.rollout.sglang.health import HealthWatch


def test_a_dead_engines_groups_are_generated_by_the_others_and_it_restarts():
    a, b = Scripted(dies_after=1), Scripted()
    restarts = Restarts(max_restarts=2)
    group = EngineGroup([a, b], names=["a", "b"], restarts=restarts)
    with group.stream() as stream:
        stream.submit([request(k) for k in range(8)])
        got = drain(stream, 8)
        assert got == {k: expected(k) for k in range(8)}  # nothing dropped, nothing twice, the same samples
        deadline = time.monotonic() + 10
        while not a.restarted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (a.killed, a.restarted) == (1, 1) and a.served == [0]
        assert restarts.scalars() == {"rollout/engine_restarts": 1.0, "rollout/resubmitted_groups": 3.0}
        stream.submit([request(k) for k in range(8, 12)])  # a restarted engine holds stale weights: none for it
        assert drain(stream, 4) == {k: expected(k) for k in range(8, 12)} and a.served == [0]
    group.update_weights([])  # the next weight update makes it current again
    with group.stream() as stream:
        stream.submit([request(k) for k in range(12, 16)])
        assert drain(stream, 4) == {k: expected(k) for k in range(12, 16)} and len(a.served) == 3


def test_rounds_regenerate_a_dead_engines_chunk_with_its_seeds():
    a, b = Scripted(dies_after=0), Scripted()
    restarts = Restarts(max_restarts=1)
    group = EngineGroup([a, b], restarts=restarts)
    prompts = [[k + 1, 7] for k in range(6)]
    want = Scripted().generate(prompts, N, SamplingParams(seed=5))
    assert group.generate(prompts, N, SamplingParams(seed=5)) == want
    assert a.restarted == 1 and restarts.resubmitted_groups == 3
    assert group.generate(prompts, N, SamplingParams(seed=5)) == want  # a is up, not current: b takes its chunk


def test_past_max_restarts_the_stream_stops_with_one_line_naming_the_engine():
    a, b = Scripted(dies_after=1), Scripted()
    group = EngineGroup([a, b], names=["http://127.0.0.1:30001", "b"], restarts=Restarts(max_restarts=0))
    with group.stream() as stream:
        stream.submit([request(k) for k in range(6)])
        with pytest.raises(EngineLostError) as err:
            drain(stream, 6)
    line = str(err.value)
    assert "\n" not in line and a.restarted == 0 and a.killed == 0
    assert "rollout engine http://127.0.0.1:30001: exited with code -9, after 0 restart(s)" in line
    assert "rollout.sglang.max_restarts=0" in line and "an illegal memory access" in line


def test_without_restarts_a_dead_engine_still_fails_the_stream():
    a, b = Scripted(dies_after=1), Scripted()
    with EngineGroup([a, b], names=["a", "b"]).stream() as stream:
        stream.submit([request(k) for k in range(4)])
        with pytest.raises(RuntimeError, match="streaming failed on rollout engine a"):
            drain(stream, 4)


def test_a_hung_server_is_noticed_by_its_health_check_and_restarted(fake_python):
    server = fake_python("serve", health_timeout_s=1.5, request_timeout_s=60)
    try:
        assert server.lost() is None
        old, port = server.pid, server.port
        os.kill(old, signal.SIGSTOP)  # hung: alive, answers nothing
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"did not answer its health check for \d+ s "
                                               r"\(rollout.sglang.health_timeout_s=1.5\) while serving POST /generate"):
            server.post("/generate", {})
        assert time.monotonic() - t0 < 15 and "health check" in server.lost()
        server.kill()
        assert process_gone(old)  # stopped for good, although stopped processes ignore a polite signal
        server.restart()
        assert server.pid != old and server.port == port and server.lost() is None and server.health()
        assert server.stale_weights  # the checkpoint's weights until the next update
    finally:
        server.shutdown()


def test_an_attached_server_whose_process_died_is_restarted_by_the_rank_that_started_it(fake_python, tmp_path):
    """Rank 0 drives another node's server (attached): it cannot see its process, so a port that refuses
    connections is its loss; its restart is a request to the rank that started it (Phases.serve's
    restart_server, here in one process), after which rank 0 attaches again. Without that, it is never lost."""
    from megatron_dapo.config import SGLangConfig
    from megatron_dapo.loop.phases import Phases
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.updates import NodeWeightSync

    owner = fake_python("serve")
    attached = SGLangEngine(tmp_path, SGLangConfig(health_timeout_s=30), python=owner.python, port=owner.port,
                            attach=True, device="cpu", log_dir=tmp_path / "logs")
    node = Phases(None, None, colocate=False, weights=NodeWeightSync.local([owner], transport="tensor",  # type: ignore[arg-type]
                                                                         bucket_bytes=64))
    try:
        assert attached.lost() is None and attached.health()
        old = owner.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while owner.dead_reason() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attached.lost() is None  # not restartable: not rank 0's to restart
        attached.restarter = lambda: node.serve(f"restart_server {attached.url}")
        assert attached.lost() == "refuses connections (its process is gone)"
        attached.kill()
        attached.restart()
        assert owner.pid != old and attached.lost() is None and attached.health() and attached.stale_weights
    finally:
        attached.shutdown()
        owner.shutdown()


def test_a_killed_server_is_reported_by_its_exit_code_though_its_workers_died_first(tiny_hf):
    """SIGKILL on a server's main process kills its workers with the thread that started them, while the main
    process is still tearing down (poll() says nothing yet): the reason is its exit code, not a dead worker."""
    from megatron_dapo.config import SGLangConfig
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    class Dying:  # a main process reaped a moment after its workers died
        pid, returncode, waits = 4242, None, []

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            self.waits.append(timeout)
            self.returncode = -9
            return -9

    server = SGLangEngine(tiny_hf("qwen2"), SGLangConfig(), attach=True, wait=False, port=server_ports())
    proc: Any = Dying()
    server._proc, server._children = proc, [(2 ** 22 + 7, 0.0)]  # no such worker
    assert server.dead_reason() == "exited with code -9" and proc.waits == [5.0]
    proc.wait = lambda timeout=None: None  # a main process that outlives its dead worker
    proc.returncode = None
    assert server.dead_reason() == f"worker process {2 ** 22 + 7} died"


def test_a_run_that_lost_an_engine_exits_1_with_one_line(monkeypatch, capsys):
    """run_training: EngineLostError (raised out of the step, before its save) is one line and exit status 1."""
    import megatron_dapo.train as train_module
    from megatron_dapo.config import Config

    lost = Restarts(max_restarts=0)
    with pytest.raises(EngineLostError) as err:
        lost.take("http://127.0.0.1:30001", "exited with code -9", "a\nb\nKilled")

    def train(cfg):
        raise err.value

    monkeypatch.setattr(train_module, "train", train)
    assert train_module.run_training(Config()) == 1
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("train: error: rollout engine http://127.0.0.1:30001: exited with "
                                               "code -9") and out[0].endswith("last lines of its log: a | b | Killed")


def test_an_engine_lost_between_rollouts_is_revived_at_the_next_phase_change():
    a, b = Scripted(), Scripted()
    restarts = Restarts(max_restarts=1)
    group = EngineGroup([a, b], restarts=restarts)
    a.dead = True  # died while the actor trained: it held no group
    group.revive()
    assert (a.killed, a.restarted, b.restarted) == (1, 1, 0) and restarts.resubmitted_groups == 0
    group.revive()  # nothing lost: nothing restarted
    assert a.restarted == 1 and restarts.engine_restarts == 1


def test_the_health_check_generates_nothing_and_falls_back_on_an_older_server():
    """The load report (SGLang's /health would generate a token), else /model_info; silence past the timeout is
    a hang."""
    asked: list[str] = []

    def older(path, timeout):
        asked.append(path)
        return 404 if path.startswith("/v1/loads") else 200

    watch, silent = HealthWatch(older, timeout_s=0.4), HealthWatch(lambda path, timeout: 503, timeout_s=0.4)
    time.sleep(0.8)
    watch.stop()
    silent.stop()
    assert watch.hung() is None and "/health" not in asked and asked[:2] == ["/v1/loads?include=core", "/model_info"]
    assert set(asked[2:]) == {"/model_info"}
    assert re.fullmatch(r"did not answer its health check for \d+ s \(rollout.sglang.health_timeout_s=0.4\)",
                        silent.hung())

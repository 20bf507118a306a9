"""Where an SGLang server runs and what it inherits: a clean environment
(no torchrun rank variables, no expandable segments), a CPU-only SGLang install refused on a GPU in one line,
and the node address other nodes reach (the routable interface, not the host name's 127.0.1.1)."""

from __future__ import annotations

import socket
import sys

import pytest
import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.sglang import environment
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerError

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def _server(tmp_path, monkeypatch, **kw) -> SGLangEngine:
    """An engine for the fake server's folder that is never started (nothing launched, nothing waited for)."""
    return SGLangEngine(tmp_path, SGLangConfig(), python=sys.executable, device="cpu",
                        log_dir=tmp_path / "logs", wait=False, attach=True, **kw)


def test_server_environment_drops_the_launchers_rank_variables(tmp_path, monkeypatch):
    for k, v in {**TORCHRUN, "HOME": "/home/x", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/trainer"}.items():
        monkeypatch.setenv(k, v)
    env = _server(tmp_path, monkeypatch)._server_env()
    assert not set(TORCHRUN) & set(env), sorted(set(TORCHRUN) & set(env))
    assert env["HOME"] == "/home/x" and env["OMP_NUM_THREADS"] == "2" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"] == "/trainer"  # the server runs our own python here: its path stays


def test_a_server_on_its_own_cpu_cores_gets_its_share_of_the_threads(tmp_path, monkeypatch):
    """rollout.colocate=false on CPU: the server runs `threads` OMP threads, not the trainer's count (its idle
    scheduler alone keeps a core busy; both sides on every core oversubscribe the machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _server(tmp_path, monkeypatch, threads=1)._server_env()["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("conf, kept", [
    ("expandable_segments:True", None),
    ("expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128"),
    ("garbage_collection_threshold:0.6, expandable_segments:True", "garbage_collection_threshold:0.6"),
    ("max_split_size_mb:64", "max_split_size_mb:64"),
])
def test_expandable_segments_never_reach_the_server(conf, kept):
    """torch_memory_saver cannot pause expandable segments: the option is cut, the others stay."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = environment.server_environment({key: conf, "X": "1"}, own_python=False, device="cuda")
        assert env.get(key) == kept and env["X"] == "1" and "SGLANG_USE_CPU_ENGINE" not in env


def test_cpu_sglang_install_is_refused_on_a_gpu_in_one_line(tmp_path, monkeypatch):
    """CUDA faked: a python without sgl_kernel, flashinfer, torch_memory_saver (the trainer's own, like the
    CPU venv of tools/sglang_venv.sh) is refused before anything starts, naming what it lacks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(SGLangEngine, "_start", lambda self: pytest.fail("a server was started"))
    with pytest.raises(SGLangServerError) as e:
        SGLangEngine(tmp_path, SGLangConfig(), python=sys.executable, log_dir=tmp_path / "logs", wait=False)
    msg = str(e.value)
    assert "\n" not in msg and "lacks sgl_kernel, flashinfer, torch_memory_saver" in msg
    assert "MEGATRON_DAPO_SGLANG_PYTHON" in msg
    no_saver = r"lacks sgl_kernel, flashinfer \(a CPU build"  # not colocated: no memory saver needed
    with pytest.raises(SGLangServerError, match=no_saver):
        SGLangEngine(tmp_path, SGLangConfig(), python=sys.executable, log_dir=tmp_path / "logs", wait=False,
                     colocate=False)


def test_cuda_modules_are_found_by_name(tmp_path):
    site = tmp_path / "site"
    for mod in ("sgl_kernel", "flashinfer", "torch_memory_saver"):
        (site / mod).mkdir(parents=True)
        (site / mod / "__init__.py").write_text("")
    exe = tmp_path / "py"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    assert environment.missing_cuda_modules(str(exe), memory_saver=True) == []


# ------------------------------------------------------------------------------------- node address


class _FakeUdp:
    connected: list = []

    def __init__(self, family, kind):
        assert kind == socket.SOCK_DGRAM

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def connect(self, addr):
        _FakeUdp.connected.append(addr[0])

    def getsockname(self):
        return ("10.1.2.3", 40000)


def test_node_address_is_the_interface_towards_the_master_not_the_host_names(monkeypatch):
    """Debian maps the host name to 127.0.1.1; the address the kernel routes towards the master is
    reachable."""
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, port, **kw: [(socket.AF_INET, 2, 17, "", (host, port))])
    monkeypatch.setattr(socket, "socket", _FakeUdp)
    _FakeUdp.connected = []
    assert environment.node_address("10.1.2.1", environ={}) == "10.1.2.3"
    assert _FakeUdp.connected == ["10.1.2.1"]
    assert environment.node_address("10.1.2.1", environ={"DAPO_NODE_ADDR": "10.9.9.9"}) == "10.9.9.9"


def test_node_address_on_loopback_master_falls_back_to_the_default_route(monkeypatch):
    addr = environment.node_address("127.0.0.1", environ={})
    assert not environment.is_loopback(addr) or environment._outgoing_address("192.0.2.1") is None


def test_loopback_address_in_a_job_on_several_hosts_is_refused_in_one_line():
    environment.check_node_addresses([(0, "127.0.0.1", "vm"), (1, "127.0.0.1", "vm")])  # nodes on one machine
    environment.check_node_addresses([(0, "10.0.0.1", "a"), (1, "10.0.0.2", "b")])
    with pytest.raises(RuntimeError) as e:
        environment.check_node_addresses([(0, "10.0.0.1", "a"), (1, "127.0.1.1", "b")])
    assert str(e.value) == ("node 1 (b) would be reached at the loopback address 127.0.1.1: set "
                            "DAPO_NODE_ADDR to an address the other nodes can reach")

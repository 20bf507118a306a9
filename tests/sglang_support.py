"""Shared by the SGLang test modules: a fake server executable (failure handling without sglang), the
real server's venv, tiny checkpoints, and teacher-forced logprob checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.sglang.engine import SGLangEngine

REPO = Path(__file__).resolve().parents[1]


def server_ports(n: int = 1) -> int:
    """A port P with P .. P+n-1 free, below the kernel's ephemeral range and outside 22000-29999, where
    SGLang picks each server's torch.distributed port. Either of those, landing on an HTTP port before
    its server binds it, took it: one server never became healthy, another failed with EADDRINUSE."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = [*range(20000, 22000 - n + 1), *range(30100, low - n + 1)]  # 30000: SGLangConfig's default
    # Under pytest-xdist each worker draws from its own blocks of 100 ports: a port another worker found free
    # a moment ago is not taken by its server before it binds it.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    candidates = [p for p in candidates if (p // 100) % workers == worker and (p + n - 1) // 100 == p // 100]
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(candidates)
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return port
    raise RuntimeError(f"no {n} consecutive free ports in 20000-21999 or 30100-{low - 1}")


FAKE_SERVER = textwrap.dedent("""
    import argparse, http.server, os, sys, time
    ap = argparse.ArgumentParser(); ap.add_argument("--port", type=int); ap.add_argument("--host")
    ap.add_argument("--api-key")
    args, _ = ap.parse_known_args()
    mode = os.environ["FAKE_SGLANG_MODE"]
    print("fake sglang starting", mode, flush=True)
    if mode == "exit":
        print("RuntimeError: not enough memory for the KV cache", flush=True)
        sys.exit(3)
    if mode == "hang":  # a slow start-up (a stop request still ends it)
        time.sleep(3600)
    if mode == "deaf":  # hung in start-up, deaf to every signal but SIGKILL
        import signal
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        print("fake sglang is deaf", flush=True)
        time.sleep(3600)
    if mode == "bindfail":  # uvicorn's error when the port is taken; SGLang then lingers in shutdown
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {args.port}): "
              "address already in use", flush=True)
        time.sleep(3600)
    class H(http.server.BaseHTTPRequestHandler):
        def refused(self):  # like SGLang's --api-key: every path but /health* needs the bearer token
            if not args.api_key or self.path.startswith("/health"):
                return False
            if self.headers.get("Authorization") == f"Bearer {args.api_key}":
                return False
            self.send_response(401); self.end_headers()
            return True
        def do_GET(self):
            if self.refused():
                return
            self.send_response(200); self.end_headers()
        def do_POST(self):
            if self.refused():
                return
            if self.path == "/init_weights_update_group":  # refuses to join: we must not wait for it
                body = b'{"success": false, "message": "Failed to initialize custom process group: boom."}'
                self.send_response(400)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            time.sleep(3600)
    http.server.ThreadingHTTPServer((args.host, args.port), H).serve_forever()
""")


@pytest.fixture
def fake_exe(tmp_path) -> Path:
    """An executable that takes sglang.launch_server's arguments and runs the fake server instead
    (its behaviour: the FAKE_SGLANG_MODE environment variable)."""
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    exe = tmp_path / "fake-python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{server}" "$@"\n')
    exe.chmod(0o755)
    return exe


@pytest.fixture
def fake_python(fake_exe, tmp_path, monkeypatch):
    """Starts one fake server in a given mode: make(mode, **SGLangConfig fields) -> SGLangEngine."""

    def make(mode: str, **cfg) -> SGLangEngine:
        monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
        return SGLangEngine(
            tmp_path,
            SGLangConfig(**cfg),
            python=str(fake_exe),
            port=server_ports(),
            device="cpu",
            log_dir=tmp_path / "logs",
            shutdown_grace_s=2,
        )

    return make


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


SGLANG_TIMEOUT = pytest.mark.timeout(
    1800
)  # the first test pays the venv build (cold ~2-3 min) + server start


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """Build (or reuse) the SGLang venv; skip the tier, saying why, only if it cannot be built."""
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "sglang_venv.sh")], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        why = "\n".join((proc.stderr or proc.stdout).splitlines()[-20:])
        print(f"tools/sglang_venv.sh failed (exit {proc.returncode}):\n{why}", file=sys.stderr)
        pytest.skip(
            f"cannot build the SGLang venv (tools/sglang_venv.sh exit {proc.returncode}): {why[-500:]}"
        )
    return proc.stdout.strip().splitlines()[-1]


def _tiny_qwen2(path: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        rope_theta=10000.0,
    )
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # peakier than the default init, so sampled tokens vary in probability
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    return {"a": _tiny_qwen2(root / "a", 0), "b": _tiny_qwen2(root / "b", 1)}


@pytest.fixture(scope="module")
def hf(models):
    """The same checkpoints in transformers (this process), single-threaded: the idle SGLang scheduler
    spins on a core, and a 2-thread torch forward beside it runs ~100x slower on a 2-core machine."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in models.items()}
    torch.set_num_threads(threads)


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=model.device)[:, None])
    return picked[:, 0].cpu()


def max_logprob_diff(model, groups) -> float:
    diffs = [
        (_teacher_forced(model, s.prompt_ids, s.response_ids) - torch.tensor(s.rollout_logprobs)).abs().max()
        for g in groups
        for s in g
    ]
    return float(torch.stack(diffs).max())


def trainer_cmd(base, tmp_path, run: str, *overrides: str) -> list[str]:
    """`python -m megatron_dapo.train` on the session's tiny base (`base`) with SGLang rollouts: test_train's
    small two-step settings, then `overrides` (later ones win)."""
    from support import train_cmd

    return train_cmd(base, tmp_path, run, "rollout.engine=sglang", "train.steps=2", "checkpoint.save_every=0",
                     "checkpoint.export_hf=false", *overrides)

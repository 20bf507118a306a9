"""SGLang servers a job starts take one API key per job (`--api-key`), and every
request the trainer sends carries it; the key is not written to the server log, which only its owner
can read. Against the fake server (it refuses every path but /health without the bearer token, as
SGLang does); `-m sglang -k "node or servers"` runs the real servers with the key."""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sglang_support import server_ports

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import SGLangServerError


def status_without_key(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/model_info", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_requests_carry_the_key_and_the_log_hides_it(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    key = "-k3y-for-this-job"  # a leading "-": argparse took it for a flag when it came as its own argument
    engine = SGLangEngine(tmp_path, SGLangConfig(), python=str(fake_exe), port=server_ports(), device="cpu",
                          log_dir=tmp_path / "logs", shutdown_grace_s=2, api_key=key)
    try:
        assert status_without_key(engine.url) == 401  # the server demands the key
        engine.call("GET", "/model_info", timeout=10)  # ours sends it
        log = engine.log_path.read_text()
        assert "'--api-key=<api key>'" in log, log[:500]
        assert key not in log
        assert stat.S_IMODE(engine.log_path.stat().st_mode) == 0o600
        without = SGLangEngine(tmp_path, SGLangConfig(), python=str(fake_exe), port=int(engine.url.rsplit(":", 1)[1]),
                               device="cpu", attach=True, wait=False)
        with pytest.raises(SGLangServerError, match="HTTP 401"):
            without.call("GET", "/model_info", timeout=10)
    finally:
        engine.shutdown()


def _two_node_worker(rank, world, master_port, exe, root, base_port):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", GROUP_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), DAPO_NODE_ADDR="127.0.0.1",
                      FAKE_SGLANG_MODE="serve")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_dapo.rollout.engine_group import EngineGroup
    from megatron_dapo.rollout.sglang.fleet import start_job_servers

    job = start_job_servers(root, SGLangConfig(base_port=base_port), python=exe, device="cpu",
                            log_dir=Path(root) / f"logs{rank}", shutdown_grace_s=2)
    def argv(e):
        return open(f"/proc/{e.pid}/cmdline").read().split("\0") if e.pid else None

    out: dict[str, list[tuple]] = {"owned": [(e.url, e.api_key, argv(e)) for e in job.owned]}
    if job.engine is not None:
        parts: list[Any] = job.engine.engines if isinstance(job.engine, EngineGroup) else [job.engine]
        for e in parts:  # the driver reaches its own server and the other node's, with the key
            e.call("GET", "/model_info", timeout=10)
        out["driver"] = [(e.url, e.api_key, e.attached, argv(e)) for e in parts]
    dist.barrier()
    job.shutdown()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_multi_node_job_shares_one_key(fake_exe, tmp_path):
    from spawn import run_ranks

    port = server_ports(2)
    run_ranks(_two_node_worker, str(fake_exe), str(tmp_path), port, timeout_s=180)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    (url0, key0, attached0, argv0), (url1, key1, attached1, _) = r0["driver"]
    assert r0["owned"] == [] and [(url, key) for url, key, _ in r1["owned"]] == [(url1, key1)]
    argv1 = r1["owned"][0][2]
    assert key0 and len(key0) >= 32 and key0 == key1 and (attached0, attached1) == (False, True)
    assert f"--api-key={key0}" in argv0 and f"--api-key={key0}" in argv1
    for rank in (0, 1):
        for log in (tmp_path / f"logs{rank}").glob("*.log"):
            assert key0 not in log.read_text()

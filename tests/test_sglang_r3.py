"""r3 routing replay on a real SGLang CPU server serving a tiny Qwen3-MoE (`-m sglang`; issue 35). A file of its own so
that `--dist loadfile` can run it beside the other long SGLang files."""

from __future__ import annotations

import os

import pytest
from sglang_support import SGLANG_TIMEOUT, server_ports, trainer_cmd


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_r3_trains_on_the_routes_an_sglang_server_returns(sglang_python, tmp_path, python_env):
    """actor.routing_replay=r3 on a real SGLang CPU server serving the tiny Qwen3-MoE: the trainer starts it with
    --enable-return-routed-experts, every sample comes back with its routes (base64 int32 in meta_info), and the
    actor's pi_old pass replays them: its own routers agree with the server's on nearly every (token, layer), and
    its logprobs stay at the server's (fp32). Streamed with partial rollout: a group aborted at a step's end comes
    back with its routes so far, and its continuation (prompt + response so far) with the server's routes of the
    rest."""
    import subprocess
    import tempfile
    from pathlib import Path

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.tiny.moe_base import ensure_moe_base

    base = ensure_moe_base(tmp_path / "moe_base", seconds=4)
    port = server_ports()
    cmd = trainer_cmd(base, tmp_path, "r3", f"rollout.sglang.base_port={port}", "actor.routing_replay=r3",
                       "reward.name=length_reward:even_length", "eval.every_steps=0",
                       "rollout.streaming=true", "rollout.partial_rollout=true")
    workers = Path(__file__).parent / "workers"
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python,
           "PYTHONPATH": f"{workers}{os.pathsep}{python_env['PYTHONPATH']}"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "routing replay r3" in r.stderr
    log = Path(tempfile.gettempdir()) / "megatron-dapo-sglang" / f"sglang-127.0.0.1-{port}.log"
    assert "--enable-return-routed-experts" in log.read_text()
    tb = read_scalars(tmp_path / "tb" / "r3")
    assert set(tb["moe/rollout_routing_agreement"]) == {1, 2}
    assert min(tb["moe/rollout_routing_agreement"].values()) > 0.95, tb["moe/rollout_routing_agreement"]
    assert tb["rollout/train_rollout_logprob_absdiff"][1] < 1e-3  # step 2 trains on carried tokens of older weights
    assert tb["rollout/resumed_groups"][2] > 0, "no group was carried into step 2: partial rollout went unexercised"

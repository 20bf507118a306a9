"""train.deterministic asks every library for it (loop/determinism.py): the environment TE, cuBLAS and NCCL read, set
before the process group exists; torch's switch, which Megatron's deterministic_mode follows; SGLang's
--enable-deterministic-inference on a GPU (its CPU engine refuses the flag); and the start-up summary says what a
resume guarantees with it off."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config import Config, SGLangConfig
from megatron_dapo.loop import determinism
from megatron_dapo.rollout.sglang.launch import DETERMINISTIC_FLAG
from megatron_dapo.rollout.sglang.server import SGLangServer


def test_the_environment_is_filled_where_unset_and_a_contradiction_refused():
    assert determinism.deterministic_env({}) == {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                                 "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    assert determinism.deterministic_env({"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Tree"}) == {
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    with pytest.raises(ValueError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO=1"):
        determinism.deterministic_env({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"})


@pytest.mark.parametrize("deterministic, device, flagged", [(True, "cuda", True), (True, "cpu", False),
                                                            (False, "cuda", False)])
def test_sglang_servers_start_deterministic_on_a_gpu(deterministic, device, flagged):
    server = SGLangServer("/models/x", SGLangConfig(), attach=True, wait=False, port=30000, device=device,
                          deterministic=deterministic)
    assert (DETERMINISTIC_FLAG in server._cmd) is flagged
    assert server._cmd.count(DETERMINISTIC_FLAG) <= 1


def test_the_trainer_passes_the_setting_to_its_servers(monkeypatch):
    from megatron_dapo.loop import engines
    from megatron_dapo.rollout.sglang import fleet

    seen = {}
    monkeypatch.setattr(fleet, "start_job_servers", lambda hf_dir, cfg, restarts, **kw: seen.update(kw))
    cfg = Config()
    cfg.train.deterministic = True
    engines._start_sglang(cfg, "/models/x", None, None)
    assert seen["deterministic"] is True


def test_megatron_follows_torchs_switch():
    from megatron_dapo.actor.model import spec_from_hf, transformer_config
    from megatron_dapo.tiny import tiny_config

    cfg = Config()
    cfg.model.dtype = "float32"
    spec = spec_from_hf(tiny_config("qwen2"))
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert transformer_config(spec, cfg.model, cfg.parallel).deterministic_mode is True
        torch.use_deterministic_algorithms(False)
        assert transformer_config(spec, cfg.model, cfg.parallel).deterministic_mode is False
    finally:
        torch.use_deterministic_algorithms(was)


def test_start_up_enables_it_before_the_process_group(monkeypatch):
    from megatron_dapo import parallel
    from megatron_dapo.loop import build
    from megatron_dapo.loop.preflight import SetupError

    order = []

    class Stop(Exception):
        pass

    def initialize(*a, **k):
        order.append("process group")
        raise Stop

    monkeypatch.setattr(determinism, "enable", lambda: order.append("determinism"))
    monkeypatch.setattr(parallel, "initialize", initialize)
    monkeypatch.setattr(build, "check_inputs", lambda cfg: (None, None))  # no model or data needed here
    cfg = Config()
    cfg.train.deterministic = True
    with pytest.raises(Stop):
        build.build_run(cfg)
    assert order == ["determinism", "process group"]
    monkeypatch.setattr(determinism, "enable", lambda: determinism.deterministic_env(
        {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}))
    with pytest.raises(SetupError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        build.build_run(cfg)


def test_the_summary_says_what_resume_guarantees_without_it():
    assert "valid continuation of this one, not the same run" in determinism.line(False, "sglang")
    on = determinism.line(True, "embedded")
    assert on.startswith("on: torch deterministic algorithms, Megatron deterministic_mode") and "NCCL_ALGO=" in on

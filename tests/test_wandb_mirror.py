"""logging.wandb in offline mode (no network): the W&B run holds the same scalars as TensorBoard, the samples
as tables and the config; a resumed writer continues the same run id; an error stops the mirror, not the
run; a whole training run with the mirror on. The offline run file is read back here (a LevelDB log of
protobuf records, W&B's own format), not trusted."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_dapo.config import WandbConfig
from megatron_dapo.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[1]
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="the wandb extra (pip install -e '.[wandb]') is not installed")
OFFLINE = WandbConfig(enabled=True, project="megatron-dapo-test", mode="offline")


@pytest.fixture(autouse=True)
def wandb_dirs(tmp_path, monkeypatch):
    """Keep W&B's config, cache and staging out of the home directory."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_offline_run(logdir: Path) -> dict:
    """{"history": [{key: value}], "config": {key: value}, "run_id", "name", "tables": {path: json}} of the
    newest offline run under logdir/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    (run_file,) = sorted(logdir.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(chunk)
            chunk = b""
    out: dict[str, Any] = {"history": [], "config": {}, "tables": {}}
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = r.history.item
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        elif kind == "run":
            out["run_id"], out["name"] = r.run.run_id, r.run.display_name
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
    for table in run_file.parent.glob("files/media/table/**/*.table.json"):
        out["tables"][str(table.relative_to(run_file.parent / "files"))] = json.loads(table.read_text())
    return out


def by_step(history: list[dict]) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for row in history:
        steps.setdefault(int(row["_step"]), {}).update(row)
    return steps


RECORDS = [{"step": 2, "split": "val", "uid": "a/0", "prompt": "1+1=", "response": "2\nAnswer: 2",
            "ground_truth": "2", "pred": "2", "reward": 1.0, "acc": True, "length": 4,
            "finish_reason": "stop"},
           {"step": 2, "split": "val", "uid": "a/1", "prompt": "2+2=", "response": "five",
            "ground_truth": "4", "pred": None, "reward": -1.0, "acc": False, "length": 2,
            "finish_reason": "length"}]


@needs_wandb
def test_scalars_samples_and_config_reach_the_offline_run(tmp_path):
    from megatron_dapo.metrics import read_scalars

    logdir = tmp_path / "runs" / "wb"
    config = {"algo": {"policy_loss": "gspo", "eps_low": None}, "train": {"steps": 3}}
    writer = MetricsWriter(logdir, wandb=OFFLINE, run_config=config)
    for step in range(3):
        writer.write(step, {"train/acc_mean": 0.25 * step, "actor/pg_loss": -0.5 + step,
                            "timing/step_s": 1.5})
    writer.write_samples(2, "val", RECORDS)
    writer.close()

    run = read_offline_run(logdir)
    tb = read_scalars(logdir)  # TensorBoard: the source of truth, written as before
    steps = by_step(run["history"])
    for tag, values in tb.items():
        assert {s: steps[s][tag] for s in values} == pytest.approx(values), tag
    assert run["config"]["algo"] == config["algo"] and run["config"]["train"] == config["train"]
    assert run["name"] == "wb" and (logdir / "wandb_run_id").read_text() == run["run_id"]
    assert steps[2]["samples/val/_type"] == "table-file" and steps[2]["samples/val/nrows"] == 2
    (table,) = run["tables"].values()
    assert table["columns"] == list(RECORDS[0])
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == RECORDS


@needs_wandb
def test_a_resumed_writer_continues_the_same_run(tmp_path):
    logdir = tmp_path / "wb"
    first = MetricsWriter(logdir, wandb=OFFLINE)
    first.write(1, {"x": 1.0})
    first.close()
    run_id = (logdir / "wandb_run_id").read_text()
    second = MetricsWriter(logdir, wandb=OFFLINE)
    second.write(2, {"x": 2.0})
    second.close()
    assert read_offline_run(logdir)["run_id"] == run_id


@needs_wandb
def test_an_error_stops_the_mirror_not_the_run(tmp_path, caplog):
    from megatron_dapo.metrics import read_scalars

    writer = MetricsWriter(tmp_path / "wb", wandb=OFFLINE)

    def broken(*args, **kwargs):
        raise ConnectionError("no route to host")

    writer._wandb.run.log = broken
    writer.write(1, {"x": 1.0})
    writer.write(2, {"x": 2.0})
    writer.close()
    assert read_scalars(tmp_path / "wb")["x"] == {1: 1.0, 2: 2.0}
    assert sum("W&B mirror stopped" in r.getMessage() for r in caplog.records) == 1


def test_a_missing_package_is_named_with_its_install_line(tmp_path, monkeypatch):
    from megatron_dapo.metrics.wandb_mirror import WandbSetupError

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(WandbSetupError, match=r"pip install \"megatron-dapo\[wandb\]\""):
        MetricsWriter(tmp_path / "wb", wandb=OFFLINE)
    MetricsWriter(tmp_path / "tb_only").close()  # the default needs no wandb


def test_config_fields():
    from megatron_dapo.config import ConfigError, load_config

    cfg = load_config(None, ["logging.wandb.enabled=true", "logging.wandb.mode=offline",
                             "logging.wandb.project=p", "logging.wandb.entity=team"])
    assert cfg.logging.wandb == WandbConfig(enabled=True, project="p", entity="team", mode="offline")
    assert not load_config(None).logging.wandb.enabled  # TensorBoard alone by default
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config(None, ["logging.wandb.mode=shared"])


@needs_wandb
def test_a_training_run_mirrors_to_wandb(base_dir, tmp_path, python_env):
    """Two steps of the tiny run with Dr. GRPO and the offline mirror: every TensorBoard scalar of every step
    is in the W&B run, with the config and the train samples; the start-up summary names the loss."""
    from megatron_dapo.metrics import read_scalars

    base = base_dir
    env = {**python_env, "WANDB_CONFIG_DIR": str(tmp_path / "wbc"), "WANDB_CACHE_DIR": str(tmp_path / "wbc"),
           "WANDB_DATA_DIR": str(tmp_path / "wbd")}
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config",
           str(REPO / "examples/configs/tiny_cpu.yaml"), f"model.hf_dir={base}",
           f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}", "logging.run_name=wb", "train.steps=2", "train.prompt_batch_size=8", "train.mini_batch_size=4",
           "algo.group_size=4", "algo.filter_metric=score", "eval.every_steps=0", "checkpoint.save_every=0",
           "checkpoint.export_hf=false", "logging.samples_every=1", "logging.samples_per_step=4",
           "algo.policy_loss=dr_grpo", "logging.wandb.enabled=true", "logging.wandb.mode=offline"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    assert ("policy loss: dr_grpo (eps_low 0.2, eps_high 0.2, token sums / (sequences x "
            "rollout.max_response_len), advantages not divided by the group std); torch") in r.stderr
    logdir = tmp_path / "tb" / "wb"
    run, tb = read_offline_run(logdir), read_scalars(logdir)
    steps = by_step(run["history"])
    assert set(steps) == {1, 2} and "actor/pg_loss" in tb
    for tag, values in tb.items():
        for step, value in values.items():
            assert steps[step][tag] == pytest.approx(value, nan_ok=True), (tag, step)
    assert run["config"]["algo"]["policy_loss"] == "dr_grpo" and run["config"]["train"]["steps"] == 2
    assert all(steps[s]["samples/train/nrows"] == 4 for s in (1, 2))

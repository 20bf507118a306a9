"""The tiny MoE recipe end to end (slow tier): `python -m megatron_dapo.tiny --recipe moe` builds a Qwen3-MoE base
(here a few warm-start steps), and examples/configs/tiny_moe_cpu.yaml trains it in one process with r2 routing replay
and at EP2 under torchrun with r3; an r3 run killed and resumed replays the straight run. A user reward of the response's length (tests/workers/length_reward.py) makes
every group informative whatever the base knows, so every step updates and the replay is exercised."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"
SMALL = ["train.steps=2", "eval.every_steps=0", "train.prompt_batch_size=8", "train.mini_batch_size=4",
         "algo.group_size=4", "reward.name=length_reward:even_length", "checkpoint.save_every=0"]

PARTIAL = ("rollout.streaming=true", "rollout.partial_rollout=true")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("moe") / "base"
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.tiny", "--recipe", "moe", "--out", str(out), "--steps",
                        "20"], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    return out


def _scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("ranks, replay, extra", [(1, "r2", ()), (2, "r3", ()), (1, "r3", PARTIAL)])
def test_the_tiny_moe_config_trains_with_replay(moe_base, tmp_path, env, ranks, replay, extra):
    """r2 in one process; r3 (the rollout's routes, scattered with their rows) under EP2; r3 with partial rollout
    (a continued sample keeps its carried tokens' routes)."""
    launch = [sys.executable, "-m", "megatron_dapo.train"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "megatron_dapo.train"]
    args = ["--config", str(REPO / "examples/configs/tiny_moe_cpu.yaml"), f"model.hf_dir={moe_base}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'runs'}", *SMALL]
    if ranks == 2:
        args.append("parallel.expert_parallel=2")
    args += [f"actor.routing_replay={replay}", *extra]
    r = subprocess.run([*launch, *args], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**env, "PYTHONPATH": f"{WORKERS}:{env['PYTHONPATH']}"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "experts sequential (megatron-core's loop over the local experts), model.moe_experts=auto" in \
        r.stdout + r.stderr  # the start-up summary names the expert kernel (grouped needs TE: tests/test_actor_gpu.py)
    scalars = _scalars(tmp_path / "runs" / "tiny_moe_cpu")
    assert len(scalars["actor/pg_loss"]) == 2  # both steps updated
    agreement = scalars["moe/routing_agreement"]
    assert len(agreement) == 2 and all(0.5 < a <= 1.0 for a in agreement), agreement
    assert all(x >= 1.0 for x in scalars["moe/expert_load_max_over_mean"])
    if replay == "r3":  # pi_old's own routers against the rollout's routes (fp32, the same weights at first)
        rollout = scalars["moe/rollout_routing_agreement"]
        assert len(rollout) == 2 and all(0.9 < a <= 1.0 for a in rollout), rollout
        assert "routing replay r3 (pi_old and the updates take the rollout's experts" in r.stdout + r.stderr
    if extra:
        assert sum(scalars["rollout/resumed_groups"]) > 0, "no group was carried: partial rollout went unexercised"


def test_a_killed_r3_run_resumes_exactly(moe_base, tmp_path, env):
    """r3 with two batches in the pipeline (rollout.async_steps=2), SIGKILLed after its step-2 checkpoint, then
    resumed: steps 3 to 5 replay the uninterrupted run's metrics, routing agreements included. Batches 3 and 4 come
    from the checkpoint, their routes from its safetensors side file; batch 5 is generated again, routes and all."""
    from support import TAGS, kill_job_at

    from megatron_dapo.metrics import read_scalars

    def cmd(run: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_moe_cpu.yaml"),
                f"model.hf_dir={moe_base}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                f"logging.tensorboard_dir={tmp_path / 'tb'}", f"logging.run_name={run}", *SMALL, "train.steps=5",
                "checkpoint.save_every=1", "actor.routing_replay=r3", "algo.dynamic_sampling=false",
                "rollout.async_steps=2", "rollout.colocate=false", *extra]

    env = {**env, "PYTHONPATH": f"{WORKERS}:{env['PYTHONPATH']}"}
    r = subprocess.run(cmd("straight"), capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    marker = tmp_path / "ckpt" / "killed" / "step_00000002" / "COMPLETE"
    kill_job_at(cmd("killed"), env, marker, timeout=900)
    assert marker.exists(), "the run never reached its step-2 checkpoint"
    assert (marker.parent / "trainer_tensors.safetensors").is_file()  # the pending batches' routes
    r = subprocess.run(cmd("killed", "checkpoint.resume=auto"), capture_output=True, text=True, timeout=900,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    a, b = read_scalars(tmp_path / "tb" / "straight"), read_scalars(tmp_path / "tb" / "killed")
    tags = [t for t in [*TAGS, "moe/routing_agreement", "moe/rollout_routing_agreement"]
            if not t.startswith(("timing/", "perf/", "val/", "memory/")) and t in a]
    assert "moe/rollout_routing_agreement" in tags and "actor/pg_loss" in tags
    for tag in tags:
        for step in (3, 4, 5):
            assert a[tag][step] == b[tag][step], (tag, step, a[tag][step], b[tag][step])

"""Rollout rows scattered to the ranks (loop/distribute.py): each data-parallel rank receives exactly its
share of the batch the driver built, TP/PP peers get it inside their group, and a DP=2 training run
gives the same losses as the old broadcast-everything path while no rank receives more than its share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.types import Group, Prompt, Sample
from spawn import run_ranks

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "train_worker.py"


def make_groups(n: int) -> list[Group]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for i in range(n):
        samples = []
        for k in range(4):
            p, r = 3 + i % 3, 2 + (i * 4 + k) % 7
            samples.append(Sample(prompt_ids=torch.randint(1, 50, (p,), generator=g).tolist(),
                                  response_ids=torch.randint(1, 50, (r,), generator=g).tolist(),
                                  rollout_logprobs=(-torch.rand(r, generator=g)).tolist(),
                                  finish_reason="length" if k == 3 else "stop", reward=float((i + k) % 2)))
        groups.append(Group(prompt=Prompt(uid=f"p/{i}", messages=(), ground_truth="1"), samples=samples))
    return groups


def _rank(rank, world, port, tp, out_dir):
    from megatron_dapo import parallel
    from megatron_dapo.actor.batching import split_rows
    from megatron_dapo.algo.advantages import group_advantages
    from megatron_dapo.algo.train_batch import build_train_batch, group_rewards, overlong_weights
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.loop import distribute

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    parallel.initialize(ParallelConfig(tensor_parallel=tp), seed=0)
    groups = make_groups(7)  # 7 groups, mini-batches of 1 x DP: trimmed to 6 (DP=2) or 7 (DP=1)
    kept = distribute.trainable(groups, 1)
    batch = build_train_batch(kept, group_advantages(group_rewards(kept)), loss_weights=overlong_weights(kept))
    got, moved = distribute.scatter(batch if rank == 0 else None)
    want = split_rows(batch, parallel.dp_size())[parallel.dp_rank()]
    fields = ("input_ids", "loss_mask", "advantages", "lengths", "rollout_logprobs", "prompt_index", "response_mask")
    same = {f: bool(torch.equal(getattr(got, f), getattr(want, f))) for f in fields}
    dtypes = {f: getattr(got, f).dtype == getattr(want, f).dtype for f in fields}
    none, nothing = distribute.scatter(None)  # the driver has no batch: every rank learns it, nothing moves
    torch.save({"same": same, "dtypes": dtypes, "rows": len(got), "none": none is None and not nothing.bytes_total,
                "total": moved.bytes_total, "received": moved.bytes_received, "max": distribute.max_received(moved),
                "dp": parallel.dp_size()}, Path(out_dir) / f"rank_{rank}.pt")
    parallel.destroy()


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_each_rank_gets_its_rows(tmp_path, tp):
    run_ranks(_rank, tp, str(tmp_path), nprocs=2, timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank_{r}.pt") for r in range(2)]
    dp = ranks[0]["dp"]
    for r in ranks:
        assert all(r["same"].values()) and all(r["dtypes"].values()), r
        assert r["rows"] == (6 if dp == 2 else 7) * 4 // dp and r["none"]
    total = ranks[0]["total"]
    assert total > 0 and ranks[0]["received"] == 0 and ranks[1]["total"] == 0
    assert ranks[0]["max"] == ranks[1]["received"] == ranks[1]["max"]
    assert ranks[1]["received"] <= total / dp * 1.1  # tp2: the peer gets the DP replica's whole share


SMALL = ["train.prompt_batch_size=8", "train.mini_batch_size=4", "algo.group_size=4", "eval.every_steps=0",
         "algo.filter_metric=score", "checkpoint.save_every=0", "checkpoint.export_hf=false", "data.val_path=",
         "train.deterministic=true", "train.steps=2"]


def torchrun(base_dir: Path, root: Path, run: str, env: dict, *flags: str) -> dict[str, dict[int, float]]:
    from megatron_dapo.parallel import free_port
    from megatron_dapo.metrics import read_scalars

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), *flags, "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base_dir}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
           f"logging.run_name={run}", *SMALL]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return read_scalars(root / "tb" / run)


@pytest.mark.slow
def test_dp2_run_equals_the_broadcast_path(base_dir, tmp_path, python_env):
    scattered = torchrun(base_dir, tmp_path, "scatter", python_env)
    reference = torchrun(base_dir, tmp_path, "broadcast", python_env, "--broadcast")
    for tag in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/clipfrac_high", "train/reward_mean",
                "rollout/train_rollout_logprob_absdiff", "response_length/mean"):
        assert scattered[tag] == reference[tag], tag  # same seed, same rows: bit-identical
    for step in (1, 2):
        total, most = scattered["perf/rollout_bytes_total"][step], scattered["perf/rollout_bytes_max_recv"][step]
        assert 0 < most <= total / 2 * 1.1, (step, total, most)

"""Actor fwd+bwd step time at TP1 vs TP2 (CPU: gloo ranks), printed as a ratio measured in one run.

    python tools/bench_actor.py [--hidden 256 --layers 4 --rows 16 --seq 256 --steps 5] [--json]

Without RANK in the environment it launches itself under torchrun for each layout and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", action="store_true")
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args()


def make_model(args: argparse.Namespace, path: Path) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from megatron_dapo.tiny import tiny_config

    torch.manual_seed(0)
    heads = max(4, args.hidden // 64)
    Qwen2ForCausalLM(tiny_config("qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                 intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                                 num_attention_heads=heads, num_key_value_heads=heads // 2,
                                 max_position_embeddings=args.seq)).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    import torch

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.config import Config
    from megatron_dapo.types import TrainBatch

    cfg = Config()
    cfg.parallel.tensor_parallel = int(os.environ["WORLD_SIZE"])
    cfg.model.dtype, cfg.actor.optimizer.warmup_steps = "float32", 0
    cfg.actor.micro_batch_tokens = args.rows * args.seq
    parallel.initialize(cfg.parallel, seed=0)
    actor = Actor.from_hf(args.hf_dir, cfg.model, cfg.parallel, cfg.actor)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g)
    batch = TrainBatch(input_ids=ids, loss_mask=torch.ones(args.rows, args.seq), lengths=torch.full((args.rows,), args.seq),
                       advantages=torch.randn(args.rows, generator=g))
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    actor.train_step(batch)  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        actor.train_step(batch)
        times.append(time.perf_counter() - t0)
    if parallel.is_main():
        Path(args.out).write_text(json.dumps({"tp": cfg.parallel.tensor_parallel, "step_s": sorted(times)[len(times) // 2]}))
    parallel.destroy()


def launch(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_model(args, Path(tmp) / "hf")
        rows = []
        for tp in args.tp:
            out = Path(tmp) / f"tp{tp}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), __file__,
                   "--hf-dir", str(Path(tmp) / "hf"), "--out", str(out), "--rows", str(args.rows),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--vocab", str(args.vocab)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
            rows.append(json.loads(out.read_text()))
    base = rows[0]["step_s"]
    for r in rows:
        tokens = args.rows * args.seq
        record = {"impl": f"megatron_tp{r['tp']}", "tokens": tokens, "step_s": r["step_s"],
                  "tokens_per_s": tokens / r["step_s"], "ratio_vs_tp1": r["step_s"] / base}
        print(json.dumps(record) if args.json else
              f"TP{r['tp']}: {r['step_s'] * 1e3:8.1f} ms/step  {record['tokens_per_s']:9.0f} tok/s  "
              f"x{record['ratio_vs_tp1']:.2f} of TP1 step time")


if __name__ == "__main__":
    a = parse()
    worker(a) if "RANK" in os.environ else launch(a)

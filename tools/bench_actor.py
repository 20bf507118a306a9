"""The actor's train step: TP1 vs TP2 step time, or (--memory) the loss implementations' peak memory.

    python tools/bench_actor.py [--hidden 256 --layers 4 --rows 16 --seq 256 --steps 5] [--json]
    python tools/bench_actor.py --memory [--json] [--device cuda] [--tokens 2048 --vocab 152064]

Default: launches itself under torchrun for each layout (CPU: gloo ranks) and prints the ratio.
--memory: one fresh process per implementation (TP1, one micro-batch of --tokens tokens, a tiny model
with Qwen2.5's vocabulary by default); `peak_loss_bytes` is the peak memory of one train step above
what the actor holds before it (parameters, grads, optimizer state; megatron_dapo.benchmark), `step_s`
the median step time. Implementations: naive = the path before issue 13 (logits upcast to fp32,
divided by the temperature, log_softmax materialised), logits / linear = actor.loss_impl.
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_dapo.actor.actor import Actor

MEMORY_IMPLS = ("naive", "logits", "linear")


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
    p.add_argument("--memory", action="store_true", help="peak memory of the loss implementations")
    p.add_argument("--tokens", type=int, default=2048, help="--memory: tokens of the step (2 rows)")
    p.add_argument("--device", default=None, help="--memory: cpu or cuda (default: cuda when available)")
    p.add_argument("--impls", nargs="+", default=list(MEMORY_IMPLS), choices=MEMORY_IMPLS)
    p.add_argument("--rounds", type=int, default=1, help="--memory: alternate the impls this many times; "
                   "keep each impl's lowest step time and peak (other load only adds to both)")
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--_impl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory and "--vocab" not in sys.argv:
        args.vocab = 152064  # Qwen2.5's
    if args.memory and "--hidden" not in sys.argv:
        args.hidden = 64
    return args


def make_model(args: argparse.Namespace, path: Path) -> None:
    from megatron_dapo.tiny import save_tiny_model

    heads = max(4, args.hidden // 64)
    save_tiny_model(path, "qwen2", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=args.hidden * 3, num_hidden_layers=args.layers, num_attention_heads=heads,
                    num_key_value_heads=heads // 2, max_position_embeddings=max(args.seq, args.tokens))


def naive_actor_class() -> type[Actor]:
    """The actor with the loss path before issue 13: fp32 upcast of the logits, temperature as a full
    copy, materialised log_softmax (the kernels' plain-torch oracle). It overrides the logits ->
    statistics step only (loss_impl=logits), so the actor's shifting and row mapping stay its own."""
    import torch

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    class NaiveActor(Actor):
        def _next_token_stats(self, out: torch.Tensor, targets: torch.Tensor, entropy: bool,
                              temperature: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            start = parallel.tp_rank() * out.shape[-1]
            valid = max(0, min(out.shape[-1], self.spec.vocab_size - start))
            z = out.float()[..., :valid]
            t = self.temperature if temperature is None else temperature
            lp, ent = reference_logprobs_and_entropy(z / t if t != 1.0 else z, targets)
            return lp, ent if entropy else None

    return NaiveActor


def memory_case(args: argparse.Namespace) -> dict:
    """One implementation in this (fresh) process: warm up, then measure one train step."""
    import gc

    import torch

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.benchmark import PeakMemory
    from megatron_dapo.config import Config
    from megatron_dapo.types import TrainBatch

    cfg = Config()
    cfg.model.dtype = "bfloat16" if args.device == "cuda" else "float32"
    cfg.model.transformer_impl = "local"
    cfg.actor.loss_impl = "logits" if args._impl == "naive" else args._impl
    cfg.actor.optimizer.warmup_steps = 0
    cfg.actor.micro_batch_tokens = cfg.actor.logprob_micro_batch_tokens = args.tokens
    parallel.initialize(cfg.parallel, seed=0)
    cls = naive_actor_class() if args._impl == "naive" else Actor
    actor = cls.from_hf(args.hf_dir, cfg.model, cfg.parallel, cfg.actor)
    g = torch.Generator().manual_seed(0)
    rows, seq = 2, args.tokens // 2
    batch = TrainBatch(input_ids=torch.randint(0, args.vocab, (rows, seq), generator=g),
                       loss_mask=torch.ones(rows, seq), lengths=torch.full((rows,), seq),
                       advantages=torch.tensor([1.0, -1.0]))
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    actor.train_step(batch)  # warm-up: creates the optimizer state
    gc.collect()
    with PeakMemory(args.device) as mem:
        actor.train_step(batch)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        actor.train_step(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    parallel.destroy()
    return {"impl": args._impl, "vocab": args.vocab, "tokens": args.tokens, "peak_loss_bytes": int(mem.peak),
            "step_s": round(sorted(times)[len(times) // 2], 4), "device": args.device, "dtype": cfg.model.dtype}


def memory(args: argparse.Namespace) -> None:
    from megatron_dapo.benchmark import load_text, run_case

    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(args, Path(tmp) / "hf")
        for _ in range(args.rounds):
            for impl in args.impls:
                cmd = [__file__, "--memory", "--_impl", impl, "--hf-dir", str(Path(tmp) / "hf"), "--device",
                       args.device, "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--steps",
                       str(args.steps)]
                row = run_case(cmd, timeout=1800, label=f"actor {impl}", env={"OMP_NUM_THREADS": str(os.cpu_count())})
                if row is not None:
                    old = best.setdefault(impl, row)
                    old.update(step_s=min(old["step_s"], row["step_s"]),
                               peak_loss_bytes=min(old["peak_loss_bytes"], row["peak_loss_bytes"]))
    rows = list(best.values())
    for row in rows:
        print(json.dumps(row) if args.json else
              f"{row['impl']:>7}: peak {row['peak_loss_bytes'] / 2**20:9.1f} MiB  {row['step_s']:.3f} s/step")
    base = best.get("naive")
    if base is not None and not args.json:
        print(f"# {args.device}, {load_text()}; ratios vs naive:")
        for r in rows:
            print(f"# {r['impl']}: peak x{r['peak_loss_bytes'] / max(base['peak_loss_bytes'], 1):.3f}, "
                  f"step time x{r['step_s'] / base['step_s']:.2f}")


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
    if a.memory and a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.memory and a._impl:
        print(json.dumps(memory_case(a)))
    elif a.memory:
        memory(a)
    else:
        worker(a) if "RANK" in os.environ else launch(a)

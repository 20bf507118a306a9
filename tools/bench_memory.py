"""Peak memory (RSS) of one DAPO step on CPU at a real vocabulary: before / after issue 12's 7b.

    python tools/bench_memory.py [--baseline-repo /path/to/older/checkout] [--vocab 49152 --hidden 576
        --layers 30 --heads 9 --kv-heads 3 --ffn 1536] [--prompts 8 --group 8 --response-len 48]

Builds a random Llama of that shape (default: SmolLM-135M-like, 135M parameters, tied embeddings) with
the tiny base's character tokenizer, then runs `megatron_dapo.train` for one step (no dynamic
sampling, one update over every response) in a fresh process per variant and reads its peak RSS
(`os.wait4`). Variants, all in this run:
  baseline    --baseline-repo's code (e.g. main before this change), micro-batches 2048 / 4096 tokens
              (tiny_cpu.yaml's), the engine loading its own copy of the weights
  shared      this checkout, the same micro-batches: the engine on the actor's parameters
  auto        this checkout, micro-batches sized from the vocabulary (the default) + shared weights
Prints one line per variant and the ratios to the first one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_model(folder: Path, a: argparse.Namespace) -> Path:
    from megatron_dapo.tiny import save_tiny_model
    from megatron_dapo.tiny.tokenizer import build_char_tokenizer, save_tokenizer

    tok = build_char_tokenizer()
    save_tiny_model(folder, "llama", tied=True, vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                    num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
                    max_position_embeddings=1024, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_tokenizer(tok, folder)
    return folder


def run_variant(repo: Path, model: Path, work: Path, a: argparse.Namespace, extra: list[str]) -> tuple[float, float]:
    """(peak RSS in GiB, seconds) of one training step in a fresh process."""
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={model}", f"checkpoint.dir={work / 'ckpt'}", f"logging.tensorboard_dir={work / 'tb'}",
           f"logging.run_name=mem{time.monotonic_ns()}", "train.steps=1", f"train.prompt_batch_size={a.prompts}",
           f"train.mini_batch_size={a.prompts}", f"algo.group_size={a.group}", "algo.dynamic_sampling=false",
           f"rollout.max_response_len={a.response_len}", "reward.overlong_cache_len=8", "eval.every_steps=0",
           "checkpoint.save_every=0", "checkpoint.export_hf=false", "checkpoint.resume=none",
           "actor.offload_when_idle=false", *extra]  # the actor keeps its weights: the engine may share them
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"variant failed ({repo}):\n{err[-3000:]}")
    return usage.ru_maxrss / 2**20, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-repo", type=Path, help="checkout whose code is the baseline (default: skip it)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--response-len", type=int, default=48)
    a = p.parse_args()
    fixed = ["actor.micro_batch_tokens=2048", "actor.logprob_micro_batch_tokens=4096"]
    variants = ([("baseline", a.baseline_repo, fixed)] if a.baseline_repo else []) + [
        ("shared", REPO, fixed), ("auto", REPO, ["actor.micro_batch_tokens=0", "actor.logprob_micro_batch_tokens=0"])]
    with tempfile.TemporaryDirectory(prefix="bench-mem-") as tmp:
        model = build_model(Path(tmp) / "model", a)
        print(f"model: llama, vocab {a.vocab}, hidden {a.hidden}, {a.layers} layers; one step over "
              f"{a.prompts} prompts x {a.group} responses (<= {a.response_len} tokens)", flush=True)
        first = None
        for name, repo, extra in variants:
            gib, seconds = run_variant(repo, model, Path(tmp), a, extra)
            first = first or gib
            print(f"{name:9s} peak RSS {gib:6.2f} GiB  x{gib / first:.2f}  ({seconds:.0f} s; {' '.join(extra)})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

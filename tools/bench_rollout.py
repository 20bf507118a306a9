"""Rollout throughput: EmbeddedEngine vs plain `transformers` `model.generate`, same weights and batch.

Both sample (temperature / top-p, no top-k) exactly --new-tokens tokens for --prompts prompts x --n
samples on a random Qwen2 model; tokens/s = prompts * n * new_tokens / wall time of one call.
The baseline is one batched `generate` call (left-padded prompts, num_return_sequences=n, default
dynamic cache) returning only token ids; the engine also returns per-token logprobs.
--sequential adds generate called once per prompt. Each impl runs --repeats times (interleaved,
after a warm-up); the median is reported.

    python tools/bench_rollout.py                       # table with ratios
    python tools/bench_rollout.py --json                # one JSON object per line
    python tools/bench_rollout.py --hidden 256 --layers 4 --vocab 4096 --prompts 4 --n 16

--dynamic instead compares a step's rollout in synchronous rounds vs streaming (the same N informative
groups per step, long-tailed lengths; see tools/bench_dynamic.py) on the embedded engine and on a real
SGLang server (its venv: $MEGATRON_DAPO_SGLANG_VENV); one JSON line per (engine, workload, mode) with --json:

    python tools/bench_rollout.py --dynamic --json
    python tools/bench_rollout.py --dynamic --json --engines embedded --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import Qwen2ForCausalLM

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.tiny import tiny_config

import bench_dynamic  # tools/bench_dynamic.py (this script's folder is on sys.path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (batch = prompts * n)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt; lengths vary in [len/2, len]")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: small models gain little, and timings stay stable)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sequential", action="store_true", help="also time generate once per prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")
    p.add_argument("--dynamic", action="store_true", help="rounds vs streaming under dynamic sampling")
    p.add_argument("--port", type=int, default=31700, help="--dynamic: the SGLang server's port")
    bench_dynamic.add_arguments(p)
    return p


def build_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_config("qwen2", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.prompt_len + args.new_tokens + 8)
    return Qwen2ForCausalLM(cfg).eval().to(args.device)


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.prompts,), generator=g)
    return [torch.randint(0, args.vocab, (int(n),), generator=g).tolist() for n in lengths]


def hf_generate(model: Qwen2ForCausalLM, prompts: list[list[int]], args: argparse.Namespace) -> int:
    """One plain batched generate call; returns the number of new tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                             top_p=args.top_p, top_k=0, num_return_sequences=args.n,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return (out.shape[1] - width) * out.shape[0]


def embedded(engine: EmbeddedEngine, prompts: list[list[int]], args: argparse.Namespace) -> int:
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.new_tokens,
                              ignore_eos=True, seed=0)
    groups = engine.generate(prompts, args.n, sampling)
    return sum(s.response_len for g in groups for s in g)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.dynamic:
        return dynamic(args)
    model = build_model(args)
    prompts = make_prompts(args)
    engine = EmbeddedEngine(model, device=args.device)
    expected = args.prompts * args.n * args.new_tokens
    impls: dict[str, Callable[[], int]] = {
        "hf_generate": lambda: hf_generate(model, prompts, args),
        "embedded": lambda: embedded(engine, prompts, args),
    }
    if args.sequential:
        impls["hf_generate_sequential"] = lambda: sum(hf_generate(model, [p], args) for p in prompts)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for name, fn in impls.items():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in impls.items():
            seconds, tokens = timed(fn)
            assert tokens == expected, f"{name} generated {tokens} tokens, expected {expected}"
            times[name].append(seconds)
    rates = {name: expected / statistics.median(ts) for name, ts in times.items()}
    report(rates, args)


def dynamic(args: argparse.Namespace) -> None:
    from megatron_dapo.rollout.sglang.server import default_python

    unknown = set(args.engines.split(",")) - {"embedded", "sglang"}
    if unknown or not args.engines:
        raise SystemExit(f"bench_rollout.py: --engines {args.engines!r}: choose from embedded, sglang")
    if "sglang" in args.engines and args.device != "cpu":
        raise SystemExit(f"bench_rollout.py: --device {args.device} moves the embedded engine only "
                         f"(SGLang runs on this CPU here): pass --engines embedded")
    if "sglang" in args.engines and default_python() == sys.executable:
        raise SystemExit("bench_rollout.py: no SGLang venv: set MEGATRON_DAPO_SGLANG_VENV "
                         "(tools/sglang_venv.sh) or pass --engines embedded")
    rows = bench_dynamic.main(args)
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        base = next(r for r in rows if r["mode"] == "rounds"
                    and (r["engine"], r["ramble_frac"]) == (row["engine"], row["ramble_frac"]))
        per_group = row["generated_tokens"] / max(row["kept_groups"], 1)
        case = row["workload"] if row["ramble_frac"] is None else f"ramble {row['ramble_frac']}"
        print(f"{row['engine']:<9}{case:<12}{row['mode']:<10} kept {row['kept_groups']:>4}  "
              f"wall {row['wall_s']:>8.2f} s "
              f"(x{row['wall_s'] / base['wall_s']:.2f})  tokens/kept group {per_group:>7.0f}  "
              f"wasted {row['wasted_tokens']:>6}  kept len {row['kept_response_len']}  forward passes "
              f"{row['forward_passes']:>6} (x{row['forward_passes'] / max(base['forward_passes'], 1):.2f})  "
              f"prefill tokens {row['prefill_tokens']:>6}")


def report(rates: dict[str, float], args: argparse.Namespace) -> None:
    batch = args.prompts * args.n
    if args.json:
        for name, rate in rates.items():
            impl = name.removesuffix("_sequential")
            row = {"impl": impl, "batch": batch, "new_tokens": args.new_tokens,
                   "tokens_per_s": round(rate, 1)}
            if name.endswith("_sequential"):
                row["mode"] = "sequential"
            print(json.dumps(row))
        return
    print(f"model: vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}, heads {args.heads}/"
          f"{args.kv_heads}; {args.prompts} prompts x n={args.n}, prompt <= {args.prompt_len}, "
          f"{args.new_tokens} new tokens, threads {torch.get_num_threads()}, device {args.device}")
    print(f"{'impl':<24}{'batch':>7}{'new_tokens':>12}{'tokens/s':>12}{'vs hf_generate':>16}")
    for name, rate in rates.items():
        print(f"{name:<24}{batch:>7}{args.new_tokens:>12}{rate:>12.0f}{rate / rates['hf_generate']:>15.2f}x")


if __name__ == "__main__":
    main()

"""The embedded engine's generation speed on a real model against this machine's compute bound (issue 40).

The recipe's rollout: its prompts rendered with the model's chat template and few-shot turns, groups streamed
through the engine's continuous batching as the trainer and the evaluation do (`--mode stream`), or one blocking
`generate` (`--mode generate`); every response runs to --new-tokens (EOS ignored), so the token count is fixed.
The bound: a matmul peak measured in this run over the model's own linear shapes at the decode batch's rows (and
at 1024 rows), best of 5 each, divided by 2 x the matmul parameters a token (the output projection included);
no decoder generates faster here. A profile splits the wall time into prefill, decode forwards and sampling.
--compare first runs each mode with top-p by a full sort of the vocabulary (transformers' TopPLogitsWarper, the
engine's sampling before issue 40), then as the engine samples now, in the same process.

    python tools/bench_generate.py --hf-dir models/SmolLM2-135M-Instruct --modes stream generate --compare
    python tools/bench_generate.py --hf-dir models/SmolLM2-135M-Instruct --prompts 4 --n 8 --new-tokens 24
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from bench_step import matmul_params, peak_flop_per_s  # tools/ is on sys.path when run as a script

from megatron_dapo.config import load_config
from megatron_dapo.data import PromptFormat, load_prompts
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.rollout.base import GroupRequest, SamplingParams
from megatron_dapo.rollout.embedded import EmbeddedEngine, continuous, decoders, sampling, slots
from megatron_dapo.rollout.embedded import engine as engine_module


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", required=True, help="the model folder (python -m megatron_dapo.smollm2 builds one)")
    p.add_argument("--config", default="examples/configs/smollm2_cpu.yaml", help="the recipe whose prompts to use")
    p.add_argument("--prompts", type=int, default=32, help="groups (the evaluation's 32 prompts)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--top-p", type=float, default=0.7, help="the evaluation's top-p (training samples at 1.0)")
    p.add_argument("--modes", nargs="+", choices=("stream", "generate"), default=["stream"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed runs after a warm-up; the best is reported")
    p.add_argument("--compare", action="store_true", help="first the same with top-p by a full sort (BEFORE)")
    p.add_argument("--json", action="store_true", help="one JSON object per mode")
    return p


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    cfg = load_config(args.config, [f"model.hf_dir={args.hf_dir}"])
    fmt = PromptFormat.from_files(cfg.data.prompt_template, cfg.data.system_prompt, cfg.data.few_shot_path)
    rows = load_prompts(cfg.data.val_path or cfg.data.train_path, prompt_format=fmt).prompts[: args.prompts]
    return [render_prompt_ids(tokenizer, p) for p in rows]


class Profile:
    """Seconds spent in the engine's prefill (`admit`), decode forwards (`step`) and sampling, by wrapping them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, label: str) -> None:
        fn: Callable = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, name, timed)


def run_once(engine: EmbeddedEngine, prompts: list[list[int]], args: argparse.Namespace, mode: str,
             seed: int) -> int:
    sampling = SamplingParams(temperature=1.0, top_p=args.top_p, max_new_tokens=args.new_tokens, ignore_eos=True,
                              seed=seed)
    if mode == "generate":
        return sum(s.response_len for g in engine.generate(prompts, args.n, sampling) for s in g)
    stream = engine.stream()
    try:
        stream.submit([GroupRequest(key=i, prompt_ids=p, n=args.n, sampling=sampling) for i, p in enumerate(prompts)])
        return sum(s.response_len for _ in prompts for s in stream.next().samples)
    finally:
        stream.close()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = EmbeddedEngine(args.hf_dir)
    from transformers import AutoTokenizer

    prompts = prompt_ids(args, AutoTokenizer.from_pretrained(args.hf_dir))
    profile = Profile()
    for decoder, prefill in ((slots.SlotDecoder, "admit"), (decoders.LlamaDecoder, "prefill")):
        profile.wrap(decoder, prefill, "prefill")
        profile.wrap(decoder, "step", "decode_forward")
    for module in (continuous, engine_module):
        profile.wrap(module, "sample_next", "sampling")
    cfg = json.loads((Path(args.hf_dir) / "config.json").read_text())
    shape = {**cfg, "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]}
    rows = len(prompts) * args.n
    peaks = {f"peak_flop_per_s_{n}_rows": peak_flop_per_s(shape, n, args.threads) for n in (rows, 1024)}
    bound = peaks[f"peak_flop_per_s_{rows}_rows"] / (2.0 * matmul_params(shape))
    now = sampling.nucleus
    for label, top_p_set in ([("before", sorted_top_p)] if args.compare else []) + [("after", now)]:
        sampling.nucleus = top_p_set
        for mode in args.modes:
            run_once(engine, prompts[:2], args, mode, seed=0)  # warm-up
            best, tokens, parts = float("inf"), 0, {}
            for r in range(args.repeats):
                profile.seconds.clear()
                t0 = time.perf_counter()
                tokens = run_once(engine, prompts, args, mode, seed=r + 1)
                if (wall := time.perf_counter() - t0) < best:
                    best, parts = wall, dict(profile.seconds)
            report(args, f"{mode}_{label}" if args.compare else mode, prompts, tokens, best, parts, peaks, bound)
    sampling.nucleus = now


def sorted_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p set by transformers' full sort of the vocabulary (what the engine ran before)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    return torch.isfinite(TopPLogitsWarper(top_p)(None, probs.log()))


def report(args: argparse.Namespace, mode: str, prompts: list[list[int]], tokens: int, seconds: float,
           parts: dict[str, float], peaks: dict[str, float], bound: float) -> None:
    rate, prompt_tokens = tokens / seconds, sum(map(len, prompts))
    out = {"mode": mode, "prompts": len(prompts), "n": args.n, "new_tokens": args.new_tokens, "top_p": args.top_p,
           "threads": args.threads, "prompt_tokens_prefilled": prompt_tokens, "generated_tokens": tokens,
           "seconds": seconds, "tokens_per_s": rate, **peaks, "bound_tokens_per_s": bound,
           "ratio_to_bound": rate / bound, "ratio_to_bound_with_prefill": (tokens + prompt_tokens) / seconds / bound,
           "profile_s": {k: round(v, 4) for k, v in parts.items()}}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{mode}: {tokens} tokens ({len(prompts)} prompts x {args.n} x {args.new_tokens}) in {seconds:.2f} s: "
          f"{rate:.1f} tokens/s = {out['ratio_to_bound']:.3f} of the bound {bound:.0f} tokens/s "
          f"({out['ratio_to_bound_with_prefill']:.3f} counting the {prompt_tokens} prefilled prompt tokens); "
          "profile: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()))


if __name__ == "__main__":
    main()

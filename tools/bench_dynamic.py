"""Rounds vs streaming rollout under dynamic sampling (`python tools/bench_rollout.py --dynamic`).

Every step needs N informative groups of G samples. Workloads (the lengths measured are printed):
- "ramble" (default): a fraction --ramble-frac of the prompts (each of a comma list in turn; 0.05, 0.1
  and 0.25 by default) ramble, every sample to --max-new-tokens; the others stop after about --answer-len
  tokens (geometric). The policy is a tiny Qwen2 with zeroed attention and MLP outputs, so the next token
  depends on the current one only: tokens [2, V/2) "answer" and emit EOS at a rate 1/answer_len, tokens
  [V/2, V) "ramble" and never emit EOS; a prompt's last token picks its regime.
- "natural": a random tiny Qwen2 with peaky weights (normal(0, --init-std)) and its EOS row scaled by
  --eos-scale: lengths depend on prompt and sample, a few responses run to the limit.
Prompt i has a difficulty p_i in {0.03, 0.5, 0.97}; a sample is "correct" when a hash of (prompt, response)
falls below p_i: informativeness does not depend on length (kept fraction ~0.47). Each step, every mode gets
the same prompts, in alternating order. "rounds" is the trainer's rounds collector (collect/rounds.py: a blocking generate per round),
"streaming" its stream collector (collect/streaming.py), "partial" that with partial rollout.
wall_s: the steps' rollout time; wasted_tokens: surplus groups trimmed (rounds) or aborted groups' tokens;
kept_response_len / kept_truncated_frac: how far streaming favours groups that finish early; prefill_tokens:
positions prefilled (embedded: padding included; SGLang: its #new-token; partial rollout prefills each
carried response again); forward_passes (SGLang: its logged batches). On this CPU a pass costs in proportion
to its rows, so wall time follows tokens; a GPU decoding a small batch is memory-bound, a pass costs about
the same whatever its rows, and wall time follows forward passes: `--engines embedded --device cuda`
measures that (tools/gpu_check.sh runs it).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.benchmark import ForwardCounter
from megatron_dapo.config import AlgoConfig, RolloutConfig, SGLangConfig
from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.collect.rounds import collect_rounds
from megatron_dapo.collect.seeds import seed_of
from megatron_dapo.collect.streaming import StreamPlan, collect_stream
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Group, Prompt

EOS = 1
DIFFICULTY = (0.03, 0.5, 0.97)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--dynamic (rounds vs streaming)")
    g.add_argument("--engines", default="embedded,sglang", help="comma-separated: embedded, sglang")
    g.add_argument("--steps", type=int, default=6)
    g.add_argument("--groups", type=int, default=16, help="N: informative groups per step")
    g.add_argument("--group-size", type=int, default=8, help="G")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch-multiplier", type=float, default=1.0)
    g.add_argument("--max-inflight-groups", type=int, default=0)
    g.add_argument("--max-carry-steps", type=int, default=RolloutConfig().max_carry_steps,
                   help="partial: drop a group aborted again after this many carries (0: no bound)")
    g.add_argument("--workload", choices=["ramble", "natural"], default="ramble")
    g.add_argument("--ramble-frac", type=_fractions, default="0.05,0.1,0.25",
                   help="ramble: the fraction of prompts that run to the limit; a comma list runs each")
    g.add_argument("--answer-len", type=float, default=20.0, help="ramble: mean length of the other responses")
    g.add_argument("--init-std", type=float, default=0.1, help="natural: weight scale")
    g.add_argument("--eos-scale", type=float, default=4.0, help="natural: EOS logit row scale")


def _fractions(text: str) -> list[float]:
    out = [float(f) for f in text.split(",") if f.strip()]
    if not out or not all(0.0 <= f <= 1.0 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions in [0, 1], comma-separated")
    return out


def build_policy(args: argparse.Namespace):
    model = tiny_model("qwen2", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=64 + args.max_new_tokens, eos_token_id=EOS, bos_token_id=0)
    torch.manual_seed(0)
    with torch.no_grad():
        if args.workload == "natural":
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, args.init_std)
            model.lm_head.weight[EOS] *= args.eos_scale
        else:
            _bigram_regimes(model, args)
    return model


def _bigram_regimes(model, args: argparse.Namespace) -> None:
    """Logits = lm_head(norm(embed(current token))): dimension 0 carries the regime (+-s), the rest noise."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    vocab, hidden = args.vocab, args.hidden
    sign = torch.where(torch.arange(vocab) >= vocab // 2, 1.0, -1.0)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    embed.normal_(0.0, 1.0)
    embed[:, 0] = 4.0 * sign
    x0 = 4.0 / math.sqrt((16.0 + hidden - 1) / hidden)  # |dimension 0| after the final RMSNorm
    head.normal_(0.0, 0.1)
    head[:, 0] = 3.0 * sign  # stay in the current regime (each token of the other is e^-6x0 less likely)
    noise = 0.5 * 0.01 * (hidden - x0**2)  # E[exp(noise logit)] = exp(sigma^2 / 2)
    same = 3.0 * x0 + noise + math.log(vocab // 2 - 2)  # log of the current regime's total mass
    head[:2] = 0.0  # <pad> (0) is never drawn: its logit 0 is e^-3x0 below a regime token's
    head[EOS, 0] = -(same - math.log(args.answer_len - 1)) / x0  # answer regime: P(EOS) = 1/answer_len


def prompt_stream(seed: int, args: argparse.Namespace) -> Iterator[tuple[Prompt, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    half = args.vocab // 2
    for i in range(10**9):
        ids = torch.randint(2, half, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g).tolist()
        p = DIFFICULTY[int(torch.randint(0, 3, (1,), generator=g))]
        if args.workload == "ramble" and float(torch.rand(1, generator=g)) < args.ramble_frac:
            ids[-1] = int(torch.randint(half, args.vocab, (1,), generator=g))
        yield Prompt(uid=f"bench/{i}", messages=(), ground_truth=str(p)), ids


def score(group: Group) -> None:
    """acc = hash(prompt, response) / 2**64 < p (the prompt's difficulty); reward +-1."""
    for s in group.samples:
        h = hashlib.blake2b(repr((group.prompt.uid, s.response_ids)).encode(), digest_size=8).digest()
        s.acc = int.from_bytes(h, "little") / 2**64 < float(group.prompt.ground_truth)
        s.reward = 1.0 if s.acc else -1.0


def sampling(args: argparse.Namespace, *key) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(EOS,), seed=seed_of(*key))


def rounds(engine: RolloutEngine, prompts: Iterator, algo: AlgoConfig, args, step: int,
           carry: PartialCarry) -> tuple[list, list]:
    """The trainer's rounds collector with this benchmark's prompts and score."""
    out = collect_rounds(engine, lambda: next(prompts), score, lambda r: sampling(args, "rounds", step, r),
                         algo=algo, target_groups=args.groups)
    return out.groups, [int(out.cost()["rollout/generated_tokens"]), out.wasted_tokens]


def streaming(engine: RolloutEngine, prompts: Iterator, algo: AlgoConfig, args,
              step: int, carry: PartialCarry | None = None) -> tuple[list, list]:
    """The trainer's stream collector; `carry` (partial rollout): the previous step's aborted groups in, this
    step's out."""
    plan = StreamPlan.from_config(algo, args.groups, args.max_inflight_groups, partial=carry is not None,
                                  max_carry_steps=args.max_carry_steps)
    out = collect_stream(engine, lambda: next(prompts), score, lambda g: sampling(args, "stream", step, g), plan,
                         group_size=algo.group_size, carry=carry)
    if carry is not None:
        carry.groups = out.carry.groups
    return out.groups, [out.stream.generated_tokens, out.stream.wasted_tokens]


MODES: dict[str, Callable] = {"rounds": rounds, "streaming": lambda *a, carry: streaming(*a),
                              "partial": streaming}


def compare(engine_name: str, engine: RolloutEngine, weights: list, args: argparse.Namespace) -> list[dict]:
    algo = AlgoConfig(group_size=args.group_size, gen_batch_multiplier=args.gen_batch_multiplier)
    carries = {m: PartialCarry() for m in MODES}
    totals: dict[str, dict[str, Any]] = {
        m: {"kept": 0, "wall": 0.0, "tokens": 0, "wasted": 0, "passes": 0, "prefill": 0, "lens": [], "cut": []}
        for m in MODES}
    counter = ForwardCounter(engine)
    for step in range(args.steps):
        for mode in list(MODES)[:: 1 if step % 2 == 0 else -1]:
            engine.update_weights(weights)  # as a training step does (SGLang: its radix cache is flushed)
            (p0, f0), t0 = counter.counts(), time.perf_counter()
            with counter.counting():
                prompts = prompt_stream(1000 + step, args)
                kept, (tokens, wasted) = MODES[mode](engine, prompts, algo, args, step, carry=carries[mode])
            wall, (p1, f1), t = time.perf_counter() - t0, counter.counts(), totals[mode]
            t["wall"] += wall
            t["passes"], t["prefill"] = t["passes"] + p1 - p0, t["prefill"] + f1 - f0
            t["kept"], t["tokens"] = t["kept"] + len(kept), t["tokens"] + tokens
            t["wasted"] += wasted
            t["lens"] += [s.response_len for g in kept for s in g.samples]
            t["cut"] += [s.truncated for g in kept for s in g.samples]
    return [{"engine": engine_name, "mode": m, "kept_groups": t["kept"], "wall_s": round(t["wall"], 3),
             "generated_tokens": t["tokens"], "wasted_tokens": t["wasted"], "forward_passes": t["passes"],
             "prefill_tokens": t["prefill"], "steps": args.steps, "workload": args.workload,
             "ramble_frac": args.ramble_frac,
             "kept_response_len": round(sum(t["lens"]) / max(len(t["lens"]), 1), 1),
             "kept_truncated_frac": round(sum(t["cut"]) / max(len(t["cut"]), 1), 3)}
            for m, t in totals.items()]


def length_percentiles(engine: RolloutEngine, args: argparse.Namespace) -> dict[str, int]:
    batch = [ids for _, (_, ids) in zip(range(32), prompt_stream(99, args))]
    lens = sorted(s.response_len for g in engine.generate(batch, args.group_size, sampling(args, "lengths"))
                  for s in g)
    return {f"p{q}": lens[min(len(lens) - 1, len(lens) * q // 100)] for q in (10, 50, 90, 100)}


def open_engine(name: str, model, folder: Path, args: argparse.Namespace) -> RolloutEngine:
    if name == "embedded":
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(model, device=args.device)
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import default_python

    model.save_pretrained(folder / "policy")
    return SGLangEngine(folder / "policy", SGLangConfig(startup_timeout_s=600, request_timeout_s=1200),
                        python=default_python(), dtype="float32", max_total_tokens=1 << 16,
                        log_dir=folder / "logs", port=args.port, extra_args=("--decode-log-interval", "1"))


def workloads(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace per run: each --ramble-frac (ramble), or the natural workload once (ramble_frac None)."""
    fracs = args.ramble_frac if args.workload == "ramble" else [None]
    return [argparse.Namespace(**{**vars(args), "ramble_frac": f}) for f in fracs]


def main(args: argparse.Namespace) -> list[dict]:
    names = [n for n in args.engines.split(",") if n]
    model = build_policy(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dynamic-") as tmp:
        for name in names:
            engine = open_engine(name, model, Path(tmp), args)
            try:
                for case in workloads(args):
                    lengths = length_percentiles(engine, case)  # (also warms the engine up)
                    if not args.json:
                        what = f"{case.workload} {case.ramble_frac or ''}".rstrip()
                        print(f"{name}, {what}: lengths {lengths} (max_new_tokens {case.max_new_tokens})")
                    rows += compare(name, engine, list(model.named_parameters()), case)
            finally:
                engine.shutdown()
    return rows

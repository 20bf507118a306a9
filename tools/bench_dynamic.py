"""Rounds vs streaming rollout under dynamic sampling (`python tools/bench_rollout.py --dynamic`).

Workload: every step needs N informative groups of G samples. The policy is a random tiny Qwen2 with
peaky weights (normal(0, --init-std)) and its EOS logit row scaled by --eos-scale, which makes the
response length depend on the prompt and the sample: a long tail, some responses running to
--max-new-tokens (the script prints the length percentiles it measured). Prompts are random token
ids; prompt i has a difficulty p_i in {0.03, 0.5, 0.97} (one third each) and a sample is "correct"
when a hash of (prompt, response ids) falls below p_i: informativeness is independent of length and
the kept fraction is about 0.47, as for a policy mid-training. Both modes run the same engine, prompts,
N, G, sampling and dynamic-sampling config, and each step the same prompt sequence: "rounds" is
loop/collect.py's loop (DynamicSampler, one blocking generate per round), "streaming" is loop/stream.py's
`stream_groups`. Steps alternate which mode goes first. wall_s sums the steps' rollout times; wasted_tokens: surplus groups trimmed (rounds) or
aborted groups' tokens (streaming); kept_response_len is the kept samples' mean length (streaming
favours groups that finish early).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_dapo.algo.dynamic_sampling import DynamicSampler, is_informative
from megatron_dapo.config import AlgoConfig, SGLangConfig
from megatron_dapo.loop.collect import seed_of
from megatron_dapo.loop.stream import StreamPlan, stream_groups
from megatron_dapo.rollout.base import GroupRequest, RolloutEngine, SamplingParams
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Group, Prompt

EOS = 1
DIFFICULTY = (0.03, 0.5, 0.97)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--dynamic (rounds vs streaming)")
    g.add_argument("--engines", default="embedded,sglang", help="comma-separated: embedded, sglang")
    g.add_argument("--steps", type=int, default=6)
    g.add_argument("--groups", type=int, default=8, help="N: informative groups per step")
    g.add_argument("--group-size", type=int, default=8, help="G")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch-multiplier", type=float, default=1.0)
    g.add_argument("--max-inflight-groups", type=int, default=0)
    g.add_argument("--init-std", type=float, default=0.1)
    g.add_argument("--eos-scale", type=float, default=4.0)


def build_policy(args: argparse.Namespace):
    torch.manual_seed(0)
    model = tiny_model("qwen2", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=64 + args.max_new_tokens, eos_token_id=EOS, bos_token_id=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, args.init_std)
        model.lm_head.weight[EOS] *= args.eos_scale
    return model


def prompt_stream(seed: int) -> Iterator[tuple[Prompt, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    for i in range(10**9):
        ids = torch.randint(2, 256, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g).tolist()
        p = DIFFICULTY[int(torch.randint(0, 3, (1,), generator=g))]
        yield Prompt(uid=f"bench/{i}", messages=(), ground_truth=str(p)), ids


def score(group: Group) -> None:
    """acc = hash(prompt, response) / 2**64 < p (the prompt's difficulty); reward +-1."""
    for s in group.samples:
        h = hashlib.blake2b(repr((group.prompt.uid, s.response_ids)).encode(), digest_size=8).digest()
        s.acc = int.from_bytes(h, "little") / 2**64 < float(group.prompt.ground_truth)
        s.reward = 1.0 if s.acc else -1.0


def sampling(args: argparse.Namespace, *key) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(EOS,), seed=seed_of(*key))


def rounds(engine: RolloutEngine, prompts: Iterator, algo: AlgoConfig, args, step: int) -> tuple[list, list]:
    """loop/collect.py's collect_step with this benchmark's prompts and score."""
    sampler = DynamicSampler(args.groups, algo.max_gen_rounds, algo.on_rounds_exhausted,
                             metric=algo.filter_metric)
    first, generated, r = math.ceil(args.groups * algo.gen_batch_multiplier), [], 0
    while not sampler.done:
        batch = [next(prompts) for _ in range(sampler.next_round_size(first))]
        out = engine.generate([ids for _, ids in batch], args.group_size, sampling(args, "rounds", step, r))
        groups = [Group(prompt=p, samples=s) for (p, _), s in zip(batch, out)]
        r += 1
        for group in groups:
            score(group)
        generated += groups
        sampler.add_round(groups)
    kept, _ = sampler.finish()
    ids = {id(g) for g in kept}
    surplus = [g for g in generated if id(g) not in ids and is_informative(g)]
    wasted = sum(s.response_len for g in surplus for s in g.samples)
    return kept, [sum(s.response_len for g in generated for s in g.samples), wasted]


def streaming(engine: RolloutEngine, prompts: Iterator, algo: AlgoConfig, args,
              step: int) -> tuple[list, list]:
    def request(g: int) -> tuple[Prompt, GroupRequest]:
        prompt, ids = next(prompts)
        return prompt, GroupRequest(key=g, prompt_ids=ids, n=args.group_size,
                                    sampling=sampling(args, "stream", step, g))

    plan = StreamPlan.from_config(algo, args.groups, args.max_inflight_groups)
    out = stream_groups(engine, request, score, plan)
    return out.groups, [out.stream.generated_tokens, out.stream.wasted_tokens]


MODES: dict[str, Callable] = {"rounds": rounds, "streaming": streaming}


def compare(engine_name: str, engine: RolloutEngine, args: argparse.Namespace) -> list[dict]:
    algo = AlgoConfig(group_size=args.group_size, gen_batch_multiplier=args.gen_batch_multiplier)
    totals = {m: {"kept": 0, "wall": 0.0, "tokens": 0, "wasted": 0, "lens": []} for m in MODES}
    for step in range(args.steps):
        order = list(MODES) if step % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            t0 = time.perf_counter()
            kept, (tokens, wasted) = MODES[mode](engine, prompt_stream(1000 + step), algo, args, step)
            t = totals[mode]
            t["wall"] += time.perf_counter() - t0
            t["kept"] += len(kept)
            t["tokens"] += tokens
            t["wasted"] += wasted
            t["lens"] += [s.response_len for g in kept for s in g.samples]
    return [{"engine": engine_name, "mode": m, "kept_groups": t["kept"], "wall_s": round(t["wall"], 3),
             "generated_tokens": t["tokens"], "wasted_tokens": t["wasted"], "steps": args.steps,
             "kept_response_len": round(sum(t["lens"]) / max(len(t["lens"]), 1), 1)}
            for m, t in totals.items()]


def length_percentiles(engine: RolloutEngine, args: argparse.Namespace) -> dict[str, int]:
    batch = [ids for _, (_, ids) in zip(range(16), prompt_stream(99))]
    lens = sorted(s.response_len for g in engine.generate(batch, args.group_size, sampling(args, "lengths"))
                  for s in g)
    return {f"p{q}": lens[min(len(lens) - 1, len(lens) * q // 100)] for q in (10, 50, 90, 100)}


def open_engine(name: str, model, folder: Path, args: argparse.Namespace) -> RolloutEngine:
    if name == "embedded":
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(model)
    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import default_python

    model.save_pretrained(folder / "policy")
    return SGLangEngine(folder / "policy", SGLangConfig(startup_timeout_s=600, request_timeout_s=1200),
                        python=default_python(), dtype="float32", max_total_tokens=1 << 16,
                        log_dir=folder / "logs", port=args.port)


def main(args: argparse.Namespace) -> list[dict]:
    names = [n for n in args.engines.split(",") if n]
    model = build_policy(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dynamic-") as tmp:
        for name in names:
            engine = open_engine(name, model, Path(tmp), args)
            try:
                lengths = length_percentiles(engine, args)
                if not args.json:
                    print(f"{name}: response lengths {lengths} (max_new_tokens {args.max_new_tokens})")
                rows += compare(name, engine, args)
            finally:
                engine.shutdown()
    return rows

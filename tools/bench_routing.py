"""Routing replay on a mixture-of-experts policy: how often the actor's routers pick the experts the rollout engine
picked, and the train/rollout logprob gap of pi_old, with actor.routing_replay none / r2 / r3, on one rollout batch.

The embedded engine samples the batch (validation prompts of the config, n each) and returns every token's routes
(SamplingParams.return_routes). The actor, on the same weights in the same dtype, computes pi_old over it:
- none and r2 route freely in that pass (r2 replays its routes only in the updates; its pi_old is none's), counting
  agreement with the rollout's routes;
- r3 replays the rollout's routes: its gap is the one left when both sides use the same experts.
The gap is the mean |log pi_old - log pi_rollout| over the generated tokens. With --steps S, S DAPO updates follow
on the batch (its pi_old and the given advantage signs), then a fresh batch, and so on: the numbers per round.

    python tools/bench_routing.py --hf-dir checkpoints/tiny_moe_base --dtype bfloat16
    python tools/bench_routing.py --hf-dir checkpoints/tiny_moe_base --dtype float32 --engine sglang

--engine sglang starts one SGLang server (--enable-return-routed-experts; on CPU in float32: its bf16 CPU kernels
are far off) and gives it the actor's weights before every batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", default="checkpoints/tiny_moe_base")
    p.add_argument("--config", default="examples/configs/tiny_moe_cpu.yaml")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="rollout batches (the actor trains between them)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def rollout(engine: Any, tokenizer: Any, prompts: list[Any], n: int, seed: int, max_new: int) -> Any:
    from megatron_dapo.algo.train_batch import build_train_batch
    from megatron_dapo.data.render import render_prompt_ids
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.types import Group

    ids = [render_prompt_ids(tokenizer, p) for p in prompts]
    out = engine.generate(ids, n, SamplingParams(max_new_tokens=max_new, seed=seed, return_routes=True,
                                                  stop_token_ids=tuple(tokenizer.all_special_ids)))
    groups = [Group(p, g) for p, g in zip(prompts, out)]
    signs = torch.tensor([1.0 if k % 2 == 0 else -1.0 for g in groups for k in range(len(g.samples))])
    return build_train_batch(groups, signs)


def measure(actor: Any, batch: Any) -> dict[str, float]:
    """pi_old over `batch` (its routes: the rollout's): agreement and the gap; leaves old_logprobs set."""
    lp, _ = actor.compute_logprobs(batch, responses_only=True, record_routes=True)
    batch.old_logprobs = lp
    gen = batch.generated()
    gap = (lp - batch.rollout_logprobs).abs()[gen].mean().item()
    agreement = actor.routing_scalars().get("moe/rollout_routing_agreement", float("nan"))
    return {"rollout_routing_agreement": agreement, "logprob_gap": gap}


def open_engine(args: argparse.Namespace) -> Any:
    if args.engine == "embedded":
        from megatron_dapo.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(args.hf_dir, dtype=getattr(torch, args.dtype))
    from megatron_dapo.parallel import free_port
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    return SGLangEngine(args.hf_dir, dtype=args.dtype, return_routes=True, port=free_port())


def run_mode(mode: str, args: argparse.Namespace, cfg: Any, prompts: list[Any], engine: Any) -> list[dict[str, float]]:
    from transformers import AutoTokenizer

    from megatron_dapo import parallel
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.actor.hf_io import export_hf_weights

    cfg.actor.routing_replay = mode
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    actor = Actor.from_hf(args.hf_dir, cfg.model, cfg.parallel, cfg.actor)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    rounds = []
    for r in range(args.rounds):
        engine.update_weights(export_hf_weights(actor.module, actor.spec, dtype))
        batch = rollout(engine, tokenizer, prompts[r * args.prompts:(r + 1) * args.prompts], args.n,
                        args.seed + r, cfg.rollout.max_response_len)
        rounds.append(measure(actor, batch))
        m = actor.train_step(batch, num_mini_batches=2)
        rounds[-1]["update_routing_agreement"] = m.get("moe/routing_agreement", float("nan"))
    del actor
    parallel.destroy()
    return rounds


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo import parallel
    from megatron_dapo.config import load_config
    from megatron_dapo.data import load_prompts

    args = parse(argv)
    cfg = load_config(args.config, [f"model.dtype={args.dtype}", f"model.hf_dir={args.hf_dir}"])
    prompts = load_prompts(cfg.data.val_path, limit=args.prompts * args.rounds).prompts
    results: dict[str, Any] = {"hf_dir": args.hf_dir, "dtype": args.dtype, "prompts": args.prompts, "n": args.n,
                               "engine": args.engine}
    engine = open_engine(args)
    try:
        for mode in ("none", "r2", "r3"):
            t0 = time.perf_counter()
            parallel.initialize(cfg.parallel, seed=args.seed)
            results[mode] = run_mode(mode, args, cfg, prompts, engine)
            print(f"{mode}: {results[mode]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(results))
    else:
        print("| replay | round | rollout routing agreement (pi_old) | mean train/rollout logprob gap | "
              "update routing agreement |\n|---|---|---|---|---|")
        for mode in ("none", "r2", "r3"):
            for i, r in enumerate(results[mode]):
                print(f"| {mode} | {i + 1} | {r['rollout_routing_agreement']:.4f} | {r['logprob_gap']:.2e} | "
                      f"{r['update_routing_agreement']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

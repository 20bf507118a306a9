"""One process: the embedded engine built on the actor's own parameters (loop/shared_weights.py).

    python tests/workers/shared_worker.py HF_DIR OUT
"""

import sys

import torch
from actor_worker import fixed_batch, make_cfg
from sync_worker import engine_vs_actor

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.loop.weight_sync import sync_weights
from megatron_dapo.loop.shared_weights import can_share, model_on_actor_weights
from megatron_dapo.rollout.embedded import EmbeddedEngine


def main() -> None:
    from transformers import AutoModelForCausalLM

    hf_dir, out = sys.argv[1], sys.argv[2]
    cfg = make_cfg(1, 1)
    parallel.initialize(cfg.parallel, seed=7)
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    model, shared = model_on_actor_weights(actor, hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = fixed_batch().input_ids
    with torch.no_grad():
        logits_diff = float((model(tokens).logits - reference(tokens).logits).abs().max())
    actor_ptrs = {p.untyped_storage().data_ptr() for p in actor.module.parameters()}
    engine = EmbeddedEngine(model)
    aliased = {n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() in actor_ptrs}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = fixed_batch()
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    actor.train_step(batch)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    still = {n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() in actor_ptrs}
    stale = engine_vs_actor(actor, engine)[0]
    stats = sync_weights(actor.module, actor.spec, engine)
    diff, max_diff = engine_vs_actor(actor, engine)
    torch.save({"can_share": can_share(actor), "shared": shared, "total": sum(p.numel() for p in model.parameters()),
                "logits_diff": logits_diff, "aliased": sorted(aliased), "moved": sorted(moved),
                "still_aliased": sorted(still), "stale": stale, "diff": diff, "max_diff": max_diff,
                "tensors": stats.tensors}, out)
    parallel.destroy()


if __name__ == "__main__":
    main()

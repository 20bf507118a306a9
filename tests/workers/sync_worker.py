"""Under torchrun: train the actor one step, sync its weights into an embedded engine on rank 0,
and compare the engine's logprobs with the actor's on the same tokens.

    torchrun --nproc_per_node N tests/workers/sync_worker.py HF_DIR OUT TP PP [EP]
"""

import sys

import torch
from actor_worker import fixed_batch, make_cfg

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.train_batch import build_train_batch, group_rewards
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.loop.weight_sync import sync_weights
from megatron_dapo.types import Group, Prompt


def main() -> None:
    hf_dir, out, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = make_cfg(tp, pp)
    cfg.parallel.expert_parallel = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    parallel.initialize(cfg.parallel, seed=7)
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    batch = fixed_batch()
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    actor.train_step(batch)  # the actor's weights now differ from hf_dir's
    engine = None
    if parallel.is_main():
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine(hf_dir)
    stale = engine_vs_actor(actor, engine)
    stats = sync_weights(actor.module, actor.spec, engine)
    diff, max_diff = engine_vs_actor(actor, engine)
    if parallel.is_main():
        torch.save({"mean_abs_diff": diff, "max_abs_diff": max_diff, "stale_mean_abs_diff": stale[0],
                    "tensors": stats.tensors, "bytes": stats.bytes, "sent_rank0": stats.bytes_sent_rank0,
                    "cross_node": stats.bytes_cross_node}, out)
    parallel.destroy()


def engine_vs_actor(actor, engine) -> tuple[float, float]:
    samples = None
    if engine is not None:
        prompts = [[5, 17, 42, 7], [99, 3, 150, 8, 8, 1]]
        samples = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))
    samples = parallel_broadcast(samples)
    groups = [Group(prompt=Prompt(uid=str(i), messages=(), ground_truth="0"), samples=s) for i, s in enumerate(samples)]
    for g in groups:
        for s in g.samples:
            s.reward = float(len(s.response_ids))
    tb = build_train_batch(groups, group_advantages(group_rewards(groups)))
    lp, _ = actor.compute_logprobs(tb)
    err = (lp - tb.rollout_logprobs).abs() * tb.response_mask
    return float(err.sum() / tb.response_mask.sum()), float(err.max())


def parallel_broadcast(obj):
    if parallel.world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()

"""Run under torchrun by tests/test_actor_prefix.py: the same grouped batch through actors with
actor.shared_prefix off and on (two actors from the same HF weights): pi_old logprobs + entropy (at every
position and at the responses only), and the metrics and gradients of the updates (two mini-batches) from the
same old logprobs; per case. Results saved per rank.

    torchrun --nproc_per_node N tests/workers/prefix_worker.py HF_DIR OUT_DIR TP PP
"""

import sys

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.hf_io import export_hf_weights
from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.train_batch import build_train_batch, group_rewards, overlong_weights
from megatron_dapo.config import Config, load_config
from megatron_dapo.types import Group, Prompt, Sample, TrainBatch

VOCAB = 200
CASES = {"logits": ("logits", []), "linear": ("linear", []),
         "gspo": ("linear", ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean",
                             "algo.eps_low=0.02", "algo.eps_high=0.02"])}
"""name: (actor.loss_impl, overrides); gspo aggregates per sequence, so rows must stay rows in the loss."""
GROUPS = [  # (prompt length, response lengths, leading tokens the responses share beyond the prompt)
    (7, [5, 9, 1, 6], 0),
    (3, [8, 2, 8, 4], 2),  # every response starts with the same two tokens: they are shared too
    (10, [3, 7, 5, 2], 0),
    (1, [6, 4, 6, 5], 0),  # a one-token prompt: the prefix is empty, each segment starts with its copy
]


def grouped_batch() -> TrainBatch:
    """Groups as the trainer builds them (prompt_index, response_mask), one response truncated."""
    g = torch.Generator().manual_seed(77)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    groups = []
    for k, (prompt_len, lengths, lead) in enumerate(GROUPS):
        prompt, common = tokens(prompt_len), tokens(lead)
        samples = []
        for i, n in enumerate(lengths):
            resp = (common + tokens(n))[:n] if n > lead else common[:n]
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=[-1.0] * n,
                                  finish_reason="length" if (k, i) == (2, 1) else "stop",
                                  reward=float((i + k) % 3 == 0)))
        groups.append(Group(Prompt(uid=f"p{k}", messages=(), ground_truth="0"), samples))
    return build_train_batch(groups, group_advantages(group_rewards(groups)), loss_weights=overlong_weights(groups))


def old_logprob_shift(batch: TrainBatch) -> torch.Tensor:
    return 0.3 * torch.sin(torch.arange(batch.input_ids.numel()).view_as(batch.input_ids) * 1.3)


def build(hf_dir: str, impl: str, overrides: list[str], shared: str, tp: int, pp: int) -> Actor:
    cfg = load_config(None, [f"actor.shared_prefix={shared}", f"actor.loss_impl={impl}", *overrides])
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.model.dtype, cfg.model.transformer_impl = "float32", "local"
    cfg.actor.optimizer.lr, cfg.actor.optimizer.warmup_steps = 1e-2, 0
    cfg.actor.optimizer.grad_clip, cfg.actor.optimizer.weight_decay = 0.0, 0.0
    cfg.actor.micro_batch_tokens = 40  # several micro-batches; the longest groups are split into parts
    cfg.actor.logprob_micro_batch_tokens = 30
    return Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor, cfg.algo, temperature=0.9)


def run_pair(hf_dir: str, impl: str, overrides: list[str], tp: int, pp: int) -> dict:
    """Both settings train on the same old logprobs (shared_prefix=off's, shifted). shared_prefix=off packs
    each micro-batch's rows into one sequence (thd); "padded" computes them as a right-padded batch; "dense"
    shares the prefix with Megatron's attention (the dense mask; SDPA computes its blocks)."""
    actors = {shared: build(hf_dir, impl, overrides, shared, tp, pp) for shared in ("off", "on")}
    actors["padded"] = build(hf_dir, impl, overrides, "off", tp, pp)
    actors["padded"].thd = 0
    if impl == "linear" and not overrides:  # Megatron's unfused attention reads the dense block mask
        actors["dense"] = build(hf_dir, impl, ["model.local_attention=megatron"], "on", tp, pp)
    batch = grouped_batch()
    stats = {shared: actor.compute_logprobs(batch) for shared, actor in actors.items()}
    responses = {shared: actors[shared].compute_logprobs(batch, responses_only=True) for shared in ("off", "on")}
    batch.old_logprobs = stats["off"][0] + old_logprob_shift(batch)
    out = {"lengths": batch.lengths, "response_mask": batch.response_mask}
    for shared, actor in actors.items():
        metrics = actor.train_step(batch, num_mini_batches=2)
        grads = {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec, grads=True)}
        out[shared] = {"shared": actor.shared_prefix, "logprobs": stats[shared][0], "entropy": stats[shared][1],
                       "responses": responses.get(shared), "metrics": metrics, "grads": grads}
    return out


def main() -> None:
    hf_dir, out, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = Config()
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    parallel.initialize(cfg.parallel, seed=3)
    results = {name: run_pair(hf_dir, impl, extra, tp, pp) for name, (impl, extra) in CASES.items()}
    torch.save(results, f"{out}/rank_{parallel.global_rank()}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()

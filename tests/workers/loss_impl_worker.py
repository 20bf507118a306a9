"""Run under torchrun by tests/test_actor_loss_impl.py: for each actor.loss_impl x temperature, a fresh
actor computes pi_old logprobs + entropy and takes one update on a fixed batch; results saved per rank.

    torchrun --nproc_per_node N tests/workers/loss_impl_worker.py HF_DIR OUT_DIR TP VOCAB [--kinds]

With --kinds: one update per policy-loss variant (KINDS) instead of the impl x temperature cases.
"""

import sys

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.hf_io import export_hf_weights
from megatron_dapo.config import Config, load_config
from megatron_dapo.types import TrainBatch

VOCAB = 200  # padded to 256 by Megatron: at TP2 rank 1 holds 72 real columns and 56 of padding
"""(A vocab of 100 also pads to 256 at TP2: rank 1's shard is padding only.)"""
CASES = [("logits", 1.0), ("linear", 1.0), ("logits", 0.7), ("linear", 0.7)]


def fixed_batch(vocab: int = VOCAB) -> TrainBatch:
    g = torch.Generator().manual_seed(4321)
    lengths = torch.tensor([14, 9, 12, 6, 14, 10])
    b, s = len(lengths), int(lengths.max())
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.zeros(b, s)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 0
        mask[i, 3:n] = 1.0
    adv = torch.tensor([1.2, -0.4, 0.8, -1.0, 0.5, -0.7])
    old_shift = 0.3 * torch.sin(torch.arange(b * s).view(b, s) * 1.3)
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=adv, lengths=lengths,
                      old_logprobs=old_shift)  # the test adds this shift to the oracle's logprobs


KINDS = {"gspo": ["algo.loss_agg_mode=seq-mean-token-mean", "algo.eps_low=0.02", "algo.eps_high=0.02"],
         "cispo": ["algo.eps_high=1.2"], "dr_grpo": []}
"""Policy-loss variants the test trains once each (TP1, loss_impl=linear), with these overrides."""
MAX_RESPONSE_LEN = 16  # Dr. GRPO's L_max


def run_case(hf_dir: str, tp: int, vocab: int, impl: str, temperature: float, loss: list[str] | None = None
             ) -> dict:
    cfg = load_config(None, loss or [])
    cfg.parallel.tensor_parallel = tp
    cfg.model.dtype = "float32"
    cfg.actor.loss_impl = impl  # type: ignore[assignment]
    cfg.actor.optimizer.lr, cfg.actor.optimizer.warmup_steps = 1e-2, 0
    cfg.actor.optimizer.grad_clip, cfg.actor.optimizer.weight_decay = 0.0, 0.0
    cfg.actor.micro_batch_tokens = 40  # several micro-batches
    cfg.actor.logprob_micro_batch_tokens = 30
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor, cfg.algo, temperature=temperature,
                          max_response_len=MAX_RESPONSE_LEN)
    batch = fixed_batch(vocab)
    shift = batch.old_logprobs
    lp, ent = actor.compute_logprobs(batch)
    batch.old_logprobs = lp + shift
    metrics = actor.train_step(batch)
    grads = {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec, grads=True)}
    return {"impl": actor.loss_impl, "logprobs": lp, "entropy": ent, "metrics": metrics, "grads": grads}


def main() -> None:
    hf_dir, out, tp, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = Config()
    cfg.parallel.tensor_parallel = tp
    parallel.initialize(cfg.parallel, seed=3)
    if len(sys.argv) > 5 and sys.argv[5] == "--kinds":
        results = {kind: run_case(hf_dir, tp, vocab, "linear", 1.0, [f"algo.policy_loss={kind}", *extra])
                   for kind, extra in KINDS.items()}
    else:
        results = {f"{impl}@{t}": run_case(hf_dir, tp, vocab, impl, t) for impl, t in CASES}
    torch.save(results, f"{out}/rank_{parallel.global_rank()}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()

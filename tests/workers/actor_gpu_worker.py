"""Run by tests/test_actor_gpu.py on a CUDA machine with Transformer Engine: the TE layer spec in bf16
(thd-packed and right-padded) beside the local spec in fp32, on the same HF weights; with `moe`, a MoE model's
grouped experts (TE's GroupedLinear) beside the sequential ones, both in the TE spec in bf16.

    PYTHONPATH=tests:. python tests/workers/actor_gpu_worker.py HF_DIR OUT_PT [moe]

A file, not a string in the test, so the type check reads it.
"""

import sys
from typing import Literal

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from workers.actor_worker import fixed_batch, make_cfg

CASES: list[tuple[str, Literal["local", "transformer_engine"], Literal["float32", "bfloat16"]]] = [
    ("local", "local", "float32"), ("te", "transformer_engine", "bfloat16"),
    ("te_padded", "transformer_engine", "bfloat16")]


def moe(hf_dir: str, out: str) -> None:
    from megatron_dapo.actor.hf_mapping import Naming
    from workers.actor_worker import hf_tensors

    cfg = make_cfg(1, 1)
    parallel.initialize(cfg.parallel, seed=7)
    cfg.model.transformer_impl, cfg.model.dtype = "transformer_engine", "bfloat16"
    res: dict[str, object] = {}
    for experts in ("sequential", "grouped"):
        cfg.model.moe_experts = experts  # type: ignore[assignment]
        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        res[experts + "_naming"] = Naming.of(n for n, _ in actor.module.named_parameters())
        res[experts + "_export"] = hf_tensors(actor)
        b = fixed_batch()
        res[experts] = logprobs = actor.compute_logprobs(b)
        b.old_logprobs = logprobs[0]
        res[experts + "_metrics"] = actor.train_step(b)
        res[experts + "_after"] = hf_tensors(actor)
    torch.save(res, out)


def main(hf_dir: str, out: str) -> None:
    cfg = make_cfg(1, 1)
    parallel.initialize(cfg.parallel, seed=7)
    res: dict[str, object] = {}
    for name, impl, dtype in CASES:
        cfg.model.transformer_impl, cfg.model.dtype = impl, dtype
        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        if name == "te_padded":
            actor.thd = 0  # a right-padded batch instead of Megatron's thd packing
        b = fixed_batch()
        res[name] = logprobs = actor.compute_logprobs(b)
        b.old_logprobs = logprobs[0]
        res[name + "_metrics"] = actor.train_step(b)
        actor.sleep()
        actor.wake()
        res[name + "_after_wake"] = actor.compute_logprobs(b)[0]
    torch.save(res, out)


if __name__ == "__main__":
    (moe if sys.argv[3:] == ["moe"] else main)(sys.argv[1], sys.argv[2])

"""Run under torchrun by tests/test_convert.py: load a converted checkpoint into the ACTOR at some TP/PP
(the trainer's path: load_checkpoint(actor, path, load_optimizer=False)), save the logits of the fixed
verification batch, export the actor in HF format (save_hf_checkpoint, config and aux files from the
checkpoint's hf/) to OUT_DIR/hf_export, and optionally write a training checkpoint (with optimizer state).

    torchrun --nproc_per_node N tests/workers/convert_worker.py CKPT OUT_DIR TP PP [TRAIN_CKPT_ROOT]
"""

import os
import sys
from pathlib import Path

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_dapo.actor.convert_checks import HF_SUBDIR
from megatron_dapo.actor.convert_verify import megatron_logits, verify_tokens
from megatron_dapo.actor.hf_io import save_hf_checkpoint
from megatron_dapo.actor.model import load_hf_config, spec_from_hf
from megatron_dapo.cli import quiet_third_party
from megatron_dapo.config import Config


def main() -> None:
    ckpt, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    quiet_third_party()
    cfg = Config()
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.model.dtype = os.environ.get("DAPO_TEST_DTYPE", "float32")  # type: ignore[assignment]
    parallel.initialize(cfg.parallel, seed=3)
    spec = spec_from_hf(load_hf_config(ckpt / HF_SUBDIR))
    actor = Actor(spec, cfg.model, cfg.parallel, cfg.actor)  # random init, then overwritten
    load_checkpoint(actor, ckpt, load_optimizer=False)
    logits = megatron_logits(actor.module, verify_tokens(spec), spec.vocab_size)
    torch.save({"logits": logits, "padded_vocab": spec.padded_vocab_size(tp)},
               out / f"rank_{parallel.global_rank()}.pt")
    save_hf_checkpoint(actor.module, spec, out / "hf_export", ckpt / HF_SUBDIR)
    if len(sys.argv) > 5:
        save_checkpoint(actor, sys.argv[5], step=3)
    parallel.destroy()


if __name__ == "__main__":
    main()

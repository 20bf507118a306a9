"""Run under torchrun by tests/test_convert.py: load a converted checkpoint into the ACTOR at some TP/PP
(the trainer's path: load_checkpoint(actor, path, load_optimizer=False)), save the logits of the fixed
verification batch, and optionally write a training checkpoint (with optimizer state) of it.

    torchrun --nproc_per_node N tests/workers/convert_worker.py CKPT OUT_DIR TP PP [TRAIN_CKPT_ROOT]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import _convert_common as cc  # noqa: E402

from megatron_dapo import parallel  # noqa: E402
from megatron_dapo.actor.actor import Actor  # noqa: E402
from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_dapo.actor.model import load_hf_config, spec_from_hf  # noqa: E402
from megatron_dapo.config import Config  # noqa: E402


def main() -> None:
    ckpt, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cc.quiet_megatron()
    cfg = Config()
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.model.dtype = "float32"
    parallel.initialize(cfg.parallel, seed=3)
    spec = spec_from_hf(load_hf_config(ckpt / cc.HF_SUBDIR))
    actor = Actor(spec, cfg.model, cfg.parallel, cfg.actor)  # random init, then overwritten
    load_checkpoint(actor, ckpt, load_optimizer=False)
    logits = cc.megatron_logits(actor.module, cc.verify_tokens(spec), spec.vocab_size)
    torch.save({"logits": logits, "padded_vocab": spec.padded_vocab_size(tp)},
               out / f"rank_{parallel.global_rank()}.pt")
    if len(sys.argv) > 5:
        save_checkpoint(actor, sys.argv[5], step=3)
    parallel.destroy()


if __name__ == "__main__":
    main()

"""Megatron distributed checkpoint -> Hugging Face folder (safetensors, config.json, tokenizer files).

    python tools/convert_megatron_to_hf.py --load ckpt/run/step_00000200 --save hf/run-step200 \\
        [--hf-dir Qwen2.5-32B] [--max-shard-size 5GB] [--dtype bfloat16] [--verify]

No --tp/--pp: a distributed checkpoint stores every tensor with its global shape, whatever TP/PP
saved it, so the tool reads it as one process without knowing the training layout (the flags are
accepted and ignored, with a note, because people pass them by habit).

--load takes a checkpoint folder (with its COMPLETE marker: a converted one, or a trainer's
step_<N>/, optimizer state is skipped) or a folder of step_<N>/ checkpoints (the latest complete one
is used). The architecture comes from config.json: the copy a converted checkpoint keeps in hf/, or
--hf-dir (both given: they must describe the same model). Tokenizer and generation-config files are
copied from --tokenizer-dir, else --hf-dir, else the checkpoint's hf/.

Streaming: tensors are read from the checkpoint one output file at a time (memory ~ one
--max-shard-size file plus one tensor); above that size the output is sharded like transformers
does (model-0000k-of-0000n.safetensors + model.safetensors.index.json).

Checks before writing: config supported and consistent with every stored tensor's shape and the
layer count, no stored model tensor left unexplained, output folder empty (or --force).
`--verify` builds an fp32 Megatron model from the checkpoint (TP=1, the whole model in memory) and
compares its logits on a fixed token batch with transformers loading the written folder.

Exit codes: 0 done (and verified), 1 verification failed, 2 invalid input or refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_dapo.actor import convert
from megatron_dapo.actor.convert_checks import CONVERSION_FILE, USER_ERRORS
from megatron_dapo.cli import quiet_third_party, run_cli

PROG = "convert_megatron_to_hf"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_IGNORED_LAYOUT_FLAGS = ("--tp", "--pp", "--tensor-parallel", "--pipeline-parallel",
                         "--tensor-model-parallel-size", "--pipeline-model-parallel-size")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, type=Path,
                   help="checkpoint folder, or a folder of step_<N>/ checkpoints (the latest is used)")
    p.add_argument("--save", required=True, type=Path, help="output HF folder (must be empty or absent)")
    p.add_argument("--hf-dir", type=Path, help="HF folder with the model's config.json (and tokenizer files)")
    p.add_argument("--tokenizer-dir", type=Path, help="copy tokenizer files from here instead")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="output dtype; auto = the checkpoint's")
    p.add_argument("--max-shard-size", default="5GB",
                   help="split the safetensors output above this size (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --save folder")
    p.add_argument("--verify", action="store_true", help="compare logits of the output with the checkpoint's")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="--verify: max allowed |logit diff| (fp32 compute)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for flag in _IGNORED_LAYOUT_FLAGS:
        p.add_argument(flag, dest="ignored_" + flag.strip("-").replace("-", "_"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_third_party()
    ignored = {k.removeprefix("ignored_"): v for k, v in vars(args).items() if k.startswith("ignored_")}
    cfg = convert.ToHF(**{k: v for k, v in vars(args).items() if not k.startswith("ignored_")})
    plan = convert.prepare_to_hf(cfg, PROG)
    _note_ignored_layout({k: v for k, v in ignored.items() if v}, plan.ckpt)
    return convert.megatron_to_hf(cfg, plan, PROG)


def _note_ignored_layout(given: dict[str, str], ckpt: Path) -> None:
    if not given:
        return
    saved = ""
    info = ckpt / CONVERSION_FILE
    if info.is_file():
        w = json.loads(info.read_text()).get("written_with", {})
        saved = f" (this one was written with TP={w.get('tensor_parallel')} PP={w.get('pipeline_parallel')})"
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
    print(f"{PROG}: note: ignoring {flags}: "
          f"the layout is read from the checkpoint, which loads at any TP/PP{saved}",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main, user_errors=USER_ERRORS))

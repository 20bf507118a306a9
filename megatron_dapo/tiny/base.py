"""The tiny base policy of the embedded default: a character-level tokenizer and a small Qwen2,
warm-started by supervised training on the built-in arithmetic task so that DAPO starts from a model
that is right some of the time (and has room to improve).

    ensure_tiny_base("checkpoints/tiny_base")          # builds on first use (~2.5 min on a 2-core CPU)
    build_tiny_base("/tmp/tb", Settings(max_steps=20), force=True)   # seconds; a useless model
    python -m megatron_dapo.tiny --out checkpoints/tiny_base   # the CLI (also tools/make_tiny_base.py)

What a build writes into `out` (Hugging Face format, loadable with AutoTokenizer / AutoModelForCausalLM):
  - tokenizer.json, tokenizer_config.json, special_tokens_map.json: the character-level tokenizer of
    `megatron_dapo.tiny.tokenizer` (no chat template);
  - config.json, model.safetensors (float32), generation_config.json (eos / pad ids);
  - base_info.json: {params, train_seconds, steps, greedy_acc, sampled_acc, seed, recipe, ...}.

Training (`warmstart`): the prompts the tiny config trains on (`TRAIN_SPEC`); the input is
`render_prompt_ids(prompt)` + a target + <eos>. The target's style is redrawn at every use
(`warmstart_data`): "Answer: 82" (what the DAPO reward reads), or "82", "The answer is 82", or 1-3
echoes of the question before "Answer: 82" (long enough to be truncated or softly punished at the tiny
config's 24-token budget). Like a pretrained base, the model ends up knowing some arithmetic but
answering in the rewarded form only part of the time; that habit, and its arithmetic, are what DAPO
can improve. When the step limit governs (the default: 1000 steps take ~150 s on a quiet 2-core CPU;
the 300 s clock is a safety cap), the build is deterministic for a seed (same machine and thread
count: bit-identical weights); when the clock does (a slow or busy machine), base_info.json says
"time_limited": true and the result depends on the machine's speed.

Measured with the defaults (0.62M parameters) on a 2-core CPU: 1000 steps in 150-220 s -> on the 256
validation prompts (`evaluation`) greedy 0.520, sampled (T=1.0) 0.295 (model.safetensors sha256
65b3c17e...; an earlier note said 0.539 / 0.331); about a third of the sampled responses use the
"Answer:" form, and with any form, the number is right about half of the time.

`ensure_tiny_base(out)` builds only when `out/base_info.json` is missing or records another recipe
fingerprint (`recipe_fingerprint`: `RECIPE` and a hash of the `Settings` defaults and the warm-start
data); then it rebuilds in place. A build writes into a temporary sibling folder and renames it into
place at the end, so `base_info.json` present means the folder is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.data.datasets import load_prompts
from megatron_dapo.tiny.evaluation import EVAL_SAMPLES, MAX_NEW_TOKENS, VAL_SPEC, evaluate
from megatron_dapo.tiny.tokenizer import build_char_tokenizer, save_tokenizer
from megatron_dapo.tiny.warmstart import Settings, build_model, count_params, torch_threads, train
from megatron_dapo.tiny.warmstart_data import RAMBLE_ECHOES, STYLE_WEIGHTS, Example, draw_style, make_examples
from megatron_dapo.types import Prompt

DEFAULT_OUT = "checkpoints/tiny_base"
TRAIN_SPEC = "builtin:arithmetic?n=4000&seed=0"
"""= data.train_path of examples/configs/tiny_cpu.yaml (2-digit operands, ops + - *)."""
INFO_FILE = "base_info.json"
RECIPE = 2
"""Version of the warm-start code (data styles, model, schedule); bump it when the code changes what a
build makes (2: mixed answer styles, see `warmstart_data`). A change of the `Settings` defaults or of
the warm-start data constants needs no bump: `recipe_fingerprint` hashes them."""


class OutputExistsError(FileExistsError):
    """--out is a non-empty folder (or a file) and --force was not given."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What a base build is: a task, warm-start data in mixed styles, a model, an evaluation.

    Two recipes exist: the tiny base of the embedded default (`arithmetic_recipe`, built into
    checkpoints/tiny_base) and the steps base of the DAPO study (`megatron_dapo.tiny.steps_base`)."""

    name: str
    """For messages ("tiny base")."""
    version: int
    """Version of the recipe's code; bump it when the code changes what a build makes."""
    train_spec: str
    val_spec: str
    settings: Settings
    """The recipe's default model and optimisation settings."""
    data: dict[str, Any]
    """The warm-start data constants (style mix, ...): hashed into the fingerprint."""
    make_examples: Callable[[Any, Sequence[Prompt]], list[Example]]
    draw: Callable[[random.Random], Hashable]
    """Draws the key of an `Example.targets` variant (its style) for one use of an example."""
    max_new_tokens: int
    eval_samples: int
    length_pool: int = 1
    """Warm-start batches grouped by length over this many batches (1: plain shuffled batches)."""

    def fingerprint(self) -> str:
        """"<version>-<hash>" of everything that shapes a default build besides the code: the
        `settings` defaults, the training prompts and the warm-start data constants."""
        settings = asdict(self.settings)
        if not settings["experts"]:  # a dense base: its fingerprint as before the MoE fields existed
            del settings["experts"], settings["experts_per_token"]
        recipe = {"settings": settings, "train_prompts": self.train_spec, **self.data}
        if self.length_pool != 1:
            recipe["length_pool"] = self.length_pool
        digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.version}-{digest}"


def arithmetic_recipe() -> Recipe:
    """The tiny base of the embedded default (read at call time: its constants are module globals)."""
    return Recipe(name="tiny base", version=RECIPE, train_spec=TRAIN_SPEC, val_spec=VAL_SPEC, settings=Settings(),
                  data={"style_weights": STYLE_WEIGHTS, "ramble_echoes": list(RAMBLE_ECHOES)},
                  make_examples=make_examples, draw=draw_style, max_new_tokens=MAX_NEW_TOKENS,
                  eval_samples=EVAL_SAMPLES)


def recipe_fingerprint(recipe: Recipe | None = None) -> str:
    """The fingerprint of `recipe` (default: the tiny base's)."""
    return (recipe or arithmetic_recipe()).fingerprint()


def _is_nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def build_tiny_base(
    out: str | Path, settings: Settings | None = None, *, force: bool = False, progress: bool = True,
    recipe: Recipe | None = None,
) -> dict[str, Any]:
    """Build, train, evaluate and save a base into `out` (default recipe: the tiny base; default
    settings: the recipe's); returns the contents of base_info.json.

    Refuses (OutputExistsError) a non-empty `out` unless `force`. Leaves the caller's torch RNG state
    and thread settings untouched.
    """
    recipe = recipe or arithmetic_recipe()
    settings = settings or recipe.settings
    out = Path(out)
    if _is_nonempty(out) and not force:
        raise OutputExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
    log = print if progress else (lambda *a, **k: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with torch.random.fork_rng(), torch_threads(settings.threads):
            torch.manual_seed(settings.seed)
            tokenizer = build_char_tokenizer(settings.max_position_embeddings)
            model = build_model(tokenizer, settings)
            info = _train_and_evaluate(model, tokenizer, settings, recipe, log, progress)
        _save(model, tokenizer, info, staging)
        if out.exists():
            if not force and _is_nonempty(out):  # appeared while we were training
                raise OutputExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"greedy accuracy {info['greedy_acc']:.3f}, sampled (T=1.0, k={recipe.eval_samples}) accuracy "
        f"{info['sampled_acc']:.3f}; saved to {out}"
    )
    return info


def _train_and_evaluate(model: Any, tokenizer: Any, settings: Settings, recipe: Recipe, log: Any, progress: bool
                        ) -> dict[str, Any]:
    """Warm-start `model` in place and evaluate it; returns the contents of base_info.json."""
    n_params = count_params(model)
    train_prompts = load_prompts(recipe.train_spec).prompts
    val_prompts = load_prompts(recipe.val_spec).prompts
    log(
        f"{recipe.name}: Qwen2 {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, "
        f"{len(train_prompts)} train prompts; "
        f"up to {settings.max_steps} steps or {settings.seconds:.0f} s"
    )
    examples = recipe.make_examples(tokenizer, train_prompts)
    trained = train(model, examples, tokenizer.pad_token_id, settings, progress=progress, draw=recipe.draw,
                    length_pool=recipe.length_pool)
    note = " - limited by --seconds: the result depends on this machine's speed"
    log(
        f"trained {trained.steps} steps in {trained.seconds:.1f} s (loss {trained.loss:.3f})"
        f"{note if trained.time_limited else ''}; evaluating on {len(val_prompts)} val prompts"
    )
    result = evaluate(model, tokenizer, val_prompts, seed=settings.seed, max_new_tokens=recipe.max_new_tokens,
                      samples=recipe.eval_samples)
    for line in result["examples"]:
        log(f"  {line}")
    return {
        "params": n_params,
        "train_seconds": round(trained.seconds, 2),
        "steps": trained.steps,
        "greedy_acc": result["greedy_acc"],
        "sampled_acc": result["sampled_acc"],
        **{k: result[k] for k in ("sampled_len_mean", "sampled_truncated") if k in result},
        "seed": settings.seed,
        "recipe": recipe.version,
        "recipe_fingerprint": recipe.fingerprint(),
        "style_weights": recipe.data["style_weights"],
        "final_loss": round(trained.loss, 4),
        "time_limited": trained.time_limited,
        "eval": {
            "prompts": recipe.val_spec,
            "samples": recipe.eval_samples,
            "temperature": 1.0,
            "max_new_tokens": recipe.max_new_tokens,
        },
        "train_prompts": recipe.train_spec,
        "settings": asdict(settings),
    }


def _save(model: Any, tokenizer: Any, info: dict[str, Any], folder: Path) -> None:
    from transformers import GenerationConfig

    folder.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)  # safetensors, float32
    save_tokenizer(tokenizer, folder)
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """An exclusive file lock next to `out`, so concurrent first uses (several ranks) build once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_base(out: str | Path = DEFAULT_OUT, seconds: float = Settings.seconds, *, seed: int = 0) -> Path:
    """`out` as a Path, after building the tiny base there if `out/base_info.json` is missing or records
    another recipe fingerprint (that folder is ours, so it is rebuilt in place).

    Raises OutputExistsError when `out` holds something else (a non-empty folder without base_info.json).
    """
    return ensure_base(arithmetic_recipe(), out, seconds, seed=seed)


def ensure_base(recipe: Recipe, out: str | Path, seconds: float | None = None, *, seed: int = 0) -> Path:
    """`ensure_tiny_base` for any recipe (`seconds` None: the recipe's time limit)."""
    out = Path(out)
    if _outdated(out, recipe) is None:
        return out
    with _build_lock(out):
        why = _outdated(out, recipe)
        if why is not None:
            settings = replace(recipe.settings, seed=seed,
                               seconds=recipe.settings.seconds if seconds is None else seconds)
            cached = _cached(recipe, settings)
            if cached is not None and _outdated(cached, recipe) is None:
                print(f"copying the {recipe.name} model from {cached} ({why}; {CACHE_ENV} is set)", flush=True)
                _copy_into(cached, out)
                return out
            print(f"building the {recipe.name} model in {out} ({why}; <= {settings.seconds:.0f} s of training)",
                  flush=True)
            build_tiny_base(out, settings, force=(out / INFO_FILE).is_file(), recipe=recipe)
            if cached is not None:
                _copy_into(out, cached)
    return out


CACHE_ENV = "MEGATRON_DAPO_BASE_CACHE"
"""A folder of built bases, one per recipe fingerprint, seed and time limit, that ensure_base copies from instead of
building (and fills after a build). Unset (the default): every checkout builds its own. .ci/run sets it, so that
each CI run does not spend minutes rebuilding the same base."""


def _cached(recipe: Recipe, settings: Settings) -> Path | None:
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    return Path(root) / f"{recipe.fingerprint()}-seed{settings.seed}-{settings.seconds:g}s"


def _copy_into(src: Path, dst: Path) -> None:
    """`dst` becomes a copy of `src`, whole or not at all (a copy beside it, then renamed into place)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.copy-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def _outdated(out: Path, recipe: Recipe) -> str | None:
    """Why the base in `out` must be (re)built, or None when it is current."""
    info_file = out / INFO_FILE
    if not info_file.is_file():
        return "first use"
    info = json.loads(info_file.read_text())
    found, expected = info.get("recipe_fingerprint"), recipe.fingerprint()
    if found == expected:
        return None
    version = info.get("recipe", 0)  # 0: built before recipes were recorded
    if version != recipe.version:
        return f"it was built by recipe {version}, this is recipe {recipe.version}"
    return f"its recipe fingerprint is {found}, this one is {expected} (the Settings defaults or data changed)"

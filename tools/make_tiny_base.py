"""Build the tiny base policy of the embedded default: a character-level tokenizer and a small Qwen2,
warm-started by supervised training on the built-in arithmetic task so that DAPO starts from a model
that is right some of the time (and has room to improve).

    python tools/make_tiny_base.py --out checkpoints/tiny_base            # ~2.5 min on a 2-core CPU
    python tools/make_tiny_base.py --out /tmp/tb --steps 20 --force       # seconds; a useless model

What it writes into --out (Hugging Face format, loadable with AutoTokenizer / AutoModelForCausalLM):
  - tokenizer.json, tokenizer_config.json, special_tokens_map.json: one token per character
    (printable ASCII and newline), the answer marker "Answer:" as one token, and <pad>, <eos> (the
    stop token), <unk>; NO chat template, so prompts render as the plain message text ("37+45="),
    see `megatron_dapo.data.render`;
  - config.json, model.safetensors (float32), generation_config.json (eos / pad ids);
  - base_info.json: {params, train_seconds, steps, greedy_acc, sampled_acc, seed, ...}.

Training: the prompts the tiny config trains on (`TRAIN_SPEC`); the input is
`render_prompt_ids(prompt)` + a target + <eos>, and the loss is the cross-entropy on the target tokens
only. The target's style is redrawn at every use (tools/_tiny_base_data.py): "Answer: 82" (what the
DAPO reward reads), or "82", "The answer is 82", or 1-3 echoes of the question before "Answer: 82"
(long enough to be truncated or softly punished at the tiny config's 24-token budget). Like a
pretrained base, the model ends up knowing some arithmetic but answering in the rewarded form only
part of the time; that habit, and its arithmetic, are what DAPO can improve.
AdamW, linear warm-up, then cosine decay. Training stops at --steps or after --seconds of wall time,
whichever comes first; the schedule follows whichever budget is further along, so a run cut by the
clock still ends annealed. When the step limit governs (the default: 1000 steps take ~150 s on a
quiet 2-core CPU; the 300 s clock is a safety cap), the build is deterministic for a --seed (same
machine and thread count: bit-identical weights); when the clock does (a slow or busy machine),
base_info.json says "time_limited": true and the result depends on the machine's speed.

Measured with the defaults (0.62M parameters) on a quiet 2-core CPU: 1000 steps in 153 s -> on the
256 validation prompts greedy 0.539, sampled (T=1.0) 0.331; about a third of the sampled responses
use the "Answer:" form, and with any form, the number is right about half of the time.

Evaluation: the validation prompts (`VAL_SPEC`), `transformers` `generate` with greedy decoding and
with plain sampling at temperature 1.0 (no top-k / top-p, `EVAL_SAMPLES` samples per prompt), at most
`MAX_NEW_TOKENS` new tokens (the config's rollout.max_response_len), scored with the DAPO reward.

`ensure_tiny_base(out)` builds only when `out/base_info.json` is missing or records an older `RECIPE`
(then it rebuilds in place); the run script calls it on first use.
A build writes into a temporary sibling folder and renames it into place at the end, so
`base_info.json` present means the folder is complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import string
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python tools/make_tiny_base.py` from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from megatron_dapo.data.datasets import load_prompts
from megatron_dapo.data.render import decode_response, render_prompt_ids
from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.types import Prompt
from tools._tiny_base_data import STYLE_WEIGHTS, Example, batches, make_examples

DEFAULT_OUT = "checkpoints/tiny_base"
TRAIN_SPEC = "builtin:arithmetic?n=4000&seed=0"
"""= data.train_path of examples/configs/tiny_cpu.yaml (2-digit operands, ops + - *)."""
VAL_SPEC = "builtin:arithmetic?n=256&seed=12345"
"""= data.val_path of examples/configs/tiny_cpu.yaml."""
MAX_NEW_TOKENS = 24
"""= rollout.max_response_len of examples/configs/tiny_cpu.yaml."""
EVAL_SAMPLES = 4
"""Samples per validation prompt at temperature 1.0 (= eval.n_samples of the tiny config)."""
INFO_FILE = "base_info.json"
RECIPE = 2
"""Version of the warm-start recipe (data styles, model, schedule): `ensure_tiny_base` rebuilds a base
whose base_info.json records another (2: mixed answer styles, see tools/_tiny_base_data.py)."""
EXIT_REFUSED = 2

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
"""Printable ASCII (digits, letters, punctuation incl. + - * = :, space) and newline: one token each."""
WORDS = ("Answer:",)
"""Whole-word tokens: the answer marker is one token, so a response "Answer: 82" is 4 tokens + <eos>."""


@dataclass(frozen=True)
class Settings:
    """Model size and optimisation of the warm-start (the defaults are the tuned embedded default)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 64
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    max_steps: int = 1000
    seconds: float = 300.0
    seed: int = 0
    threads: int | None = 1
    """torch intra-op threads while building. One: this model's matrices are too small to gain much
    from a second thread, and on a busy 2-core machine two threads cost several times more (measured:
    ~8x CPU per step under load). None leaves torch's setting."""


# ----------------------------------------------------------------------------------------- tokenizer


def build_char_tokenizer(model_max_length: int = 64) -> Any:
    """A character-level `PreTrainedTokenizerFast`: <pad>=0, <eos>=1, <unk>=2, one id per character of
    `CHARACTERS`, then the `WORDS` ("Answer:"), each one token wherever it occurs.

    No BOS and no chat template; `decode` joins tokens without separators; characters outside
    `CHARACTERS` encode as <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    pieces = "|".join(re.escape(word) for word in WORDS) + r"|[\s\S]"  # a whole word, else one character
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pieces), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """`save_pretrained`, plus what older transformers (and other loaders) look for.

    transformers 5 records its own backend class name and no special_tokens_map.json; the generic
    "PreTrainedTokenizerFast" class loads in both 4.x and 5.x.
    """
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    special = {"pad_token": PAD_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# ------------------------------------------------------------------------------------------- model


def build_model(tokenizer: Any, settings: Settings) -> Any:
    """A randomly initialised float32 Qwen2ForCausalLM sized by `settings` (uses the global torch RNG)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------- training


def lr_factor(step: int, elapsed: float, settings: Settings) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 0.1 over whichever budget binds first.

    Progress is max(step / max_steps, elapsed / seconds), so a run cut by the time limit still ends
    with a decayed learning rate instead of stopping mid-schedule.
    """
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = min(1.0, max(step / settings.max_steps, elapsed / settings.seconds))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps: int
    seconds: float
    loss: float
    """Mean loss per target token over the last 50 steps."""
    time_limited: bool
    """True when wall time (not the step count) shaped the run: it stopped early or its lr schedule
    was driven by the clock at some step, so the result depends on the machine's speed."""


def train(
    model: Any, examples: Sequence[Example], pad_id: int, settings: Settings, *, progress: bool
) -> TrainResult:
    """Supervised warm-start (loss on the target tokens only) until max_steps or `seconds` of wall time."""
    from tqdm import tqdm

    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=settings.weight_decay
    )
    model.train()
    data = batches(examples, settings.batch_size, pad_id, rng)
    recent: list[float] = []
    steps, time_limited = 0, False
    start = time.monotonic()
    bar = tqdm(total=settings.max_steps, desc="warm-start", unit="step", disable=not progress, leave=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)  # a log file gets a line per 10 s
    with bar:
        while steps < settings.max_steps:
            elapsed = time.monotonic() - start
            if elapsed >= settings.seconds:
                time_limited = True
                break
            clock_ahead = elapsed / settings.seconds > steps / settings.max_steps
            time_limited |= steps >= settings.warmup_steps and clock_ahead  # the clock drives the lr
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * lr_factor(steps, elapsed, settings)
            input_ids, labels = next(data)
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
            recent = (recent + [loss.item()])[-50:]
            bar.update(1)
            if steps % 10 == 0:
                bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    model.eval()
    mean_loss = sum(recent) / len(recent) if recent else float("nan")
    return TrainResult(steps, time.monotonic() - start, mean_loss, time_limited)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` intra-op threads (None: leave as is), restoring the caller's setting after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_responses(
    model: Any, tokenizer: Any, prompts: Sequence[Prompt], *, sample: bool, n: int = 1, seed: int = 0
) -> list[list[str]]:
    """`n` responses per prompt with `model.generate` (greedy, or plain sampling at temperature 1.0)."""
    rendered = [render_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(ids) for ids in rendered)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.full((len(rendered), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rendered), width), dtype=torch.long)
    for row, ids in enumerate(rendered):  # left padding
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    kwargs: dict[str, Any] = dict(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=pad)
    if sample:
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n)
    else:
        kwargs.update(do_sample=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    responses: list[list[str]] = [[] for _ in prompts]
    for row, seq in enumerate(out[:, width:].tolist()):
        if eos in seq:
            seq = seq[: seq.index(eos)]
        responses[row // (n if sample else 1)].append(decode_response(tokenizer, seq))
    return responses


def accuracy(prompts: Sequence[Prompt], responses: Sequence[Sequence[str]]) -> float:
    """Mean DAPO-reward accuracy over every response of every prompt."""
    hits = [compute_score(r, p.ground_truth).acc for p, rs in zip(prompts, responses) for r in rs]
    return sum(hits) / len(hits) if hits else 0.0


def evaluate(model: Any, tokenizer: Any, prompts: Sequence[Prompt], *, seed: int) -> dict[str, Any]:
    """Greedy and sampled (T=1.0, `EVAL_SAMPLES` per prompt) accuracy, and a few example responses."""
    greedy = generate_responses(model, tokenizer, prompts, sample=False)
    sampled = generate_responses(model, tokenizer, prompts, sample=True, n=EVAL_SAMPLES, seed=seed)
    examples = [
        f"{''.join(m['content'] for m in p.messages)} -> {g[0]!r} (truth {p.ground_truth})"
        for p, g in zip(prompts[:4], greedy[:4])
    ]
    return {
        "greedy_acc": accuracy(prompts, greedy),
        "sampled_acc": accuracy(prompts, sampled),
        "examples": examples,
    }


# ------------------------------------------------------------------------------------------- build


class OutputExistsError(FileExistsError):
    """--out is a non-empty folder (or a file) and --force was not given."""


def _is_nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def build_tiny_base(
    out: str | Path, settings: Settings = Settings(), *, force: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Build, train, evaluate and save the tiny base into `out`; returns the contents of base_info.json.

    Refuses (OutputExistsError) a non-empty `out` unless `force`. Leaves the caller's torch RNG state
    and thread settings untouched.
    """
    from transformers import GenerationConfig

    out = Path(out)
    if _is_nonempty(out) and not force:
        raise OutputExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
    log = print if progress else (lambda *a, **k: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with torch.random.fork_rng(), _torch_threads(settings.threads):
            torch.manual_seed(settings.seed)
            tokenizer = build_char_tokenizer(settings.max_position_embeddings)
            model = build_model(tokenizer, settings)
            n_params = count_params(model)
            train_prompts = load_prompts(TRAIN_SPEC).prompts
            val_prompts = load_prompts(VAL_SPEC).prompts
            log(
                f"tiny base: Qwen2 {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, "
                f"{len(train_prompts)} train prompts; "
                f"up to {settings.max_steps} steps or {settings.seconds:.0f} s"
            )
            examples = make_examples(tokenizer, train_prompts)
            trained = train(model, examples, tokenizer.pad_token_id, settings, progress=progress)
            note = " - limited by --seconds: the result depends on this machine's speed"
            log(
                f"trained {trained.steps} steps in {trained.seconds:.1f} s (loss {trained.loss:.3f})"
                f"{note if trained.time_limited else ''}; evaluating on {len(val_prompts)} val prompts"
            )
            result = evaluate(model, tokenizer, val_prompts, seed=settings.seed)
        for line in result["examples"]:
            log(f"  {line}")
        info = {
            "params": n_params,
            "train_seconds": round(trained.seconds, 2),
            "steps": trained.steps,
            "greedy_acc": result["greedy_acc"],
            "sampled_acc": result["sampled_acc"],
            "seed": settings.seed,
            "recipe": RECIPE,
            "style_weights": STYLE_WEIGHTS,
            "final_loss": round(trained.loss, 4),
            "time_limited": trained.time_limited,
            "eval": {
                "prompts": VAL_SPEC,
                "samples": EVAL_SAMPLES,
                "temperature": 1.0,
                "max_new_tokens": MAX_NEW_TOKENS,
            },
            "train_prompts": TRAIN_SPEC,
            "settings": asdict(settings),
        }
        staging.mkdir(parents=True)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.save_pretrained(staging)  # safetensors, float32
        save_tokenizer(tokenizer, staging)
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            if not force and _is_nonempty(out):  # appeared while we were training
                raise OutputExistsError(f"{out} exists and is not empty; pass --force to overwrite it")
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"greedy accuracy {info['greedy_acc']:.3f}, sampled (T=1.0, k={EVAL_SAMPLES}) accuracy "
        f"{info['sampled_acc']:.3f}; saved to {out}"
    )
    return info


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
    an older recipe (that folder is ours, so it is rebuilt in place).

    Raises OutputExistsError when `out` holds something else (a non-empty folder without base_info.json).
    """
    out = Path(out)
    if _recipe(out) == RECIPE:
        return out
    with _build_lock(out):
        found = _recipe(out)
        if found != RECIPE:
            why = "first use" if found is None else f"it was built by recipe {found}, this is recipe {RECIPE}"
            print(f"building the tiny base model in {out} ({why}; <= {seconds:.0f} s of training)", flush=True)
            build_tiny_base(out, Settings(seconds=seconds, seed=seed), force=found is not None)
    return out


def _recipe(out: Path) -> int | None:
    """The recipe recorded in out/base_info.json (0 for a build older than recipes), None if absent."""
    info = out / INFO_FILE
    return int(json.loads(info.read_text()).get("recipe", 0)) if info.is_file() else None


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--seconds", type=float, default=Settings.seconds, help="wall-time limit of training")
    p.add_argument("--steps", type=int, default=Settings.max_steps,
                   help="step limit (and length of the lr schedule)")
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--threads", type=int, default=Settings.threads,
                   help="torch threads while building (default 1; 0 leaves torch's default)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.seconds <= 0:
        print("error: --steps and --seconds must be positive", file=sys.stderr)
        return EXIT_REFUSED
    settings = Settings(
        seconds=args.seconds, max_steps=args.steps, seed=args.seed, threads=args.threads or None
    )
    try:
        build_tiny_base(args.out, settings, force=args.force)
    except OutputExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())

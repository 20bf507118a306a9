"""Evaluate a policy on its own: k samples per prompt -> avg@k, pass@k, maj@k (the code the trainer's
validation runs, loop/evaluation.py).

    python -m megatron_dapo.evaluate --model checkpoints/tiny_cpu/hf_final \\
        --data "builtin:arithmetic?n=256&seed=12345" --n 32 --temperature 1.0 --top-p 0.7 \\
        [--max-prompts 100] [--max-response-len 1024] [--engine embedded|sglang] [--out results.jsonl] \\
        [--config run.yaml] [section.key=value ...]

--n, --max-prompts, --max-response-len: the flag, else --config / an override (eval.n_samples,
eval.max_prompts, rollout.max_response_len), else on a CPU an evaluation sized to finish in minutes
(CPU_DEFAULTS), on a GPU the config's defaults (the paper's 32 samples of every prompt).

--model: a Hugging Face folder, or a Megatron checkpoint (a step_<N>/ folder, or a run folder of them:
the newest complete one), converted in this process to a temporary HF folder first.
--data: a dataset path or builtin:... spec, as data.val_path.
Everything else that shapes a prompt or a score comes from --config and overrides, as in training:
data.prompt_template / system_prompt / few_shot_path, model.chat_template, reward.name /
answer_fallback; flags win over the config. Rewards are the verifier's score (no overlong term).

Output: a progress bar (stderr) that advances as each prompt's k samples finish (the engine streams
them), with generated tokens per second; one JSON record per prompt in --out (default
runs/eval/<run>-<step_N or hf_final>.jsonl for a run's checkpoint or export, runs/eval/<folder>.jsonl for
another HF folder), and ONE JSON summary line on stdout naming what was evaluated. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.cli import UserError, quiet_third_party, run_cli
from megatron_dapo.collect.seeds import eos_ids
from megatron_dapo.config import Config, ConfigError, load_config
from megatron_dapo.config.loading import read_yaml

PROG = "evaluate"
CPU_DEFAULTS = {"eval.n_samples": 4, "eval.max_prompts": 32, "rollout.max_response_len": 256}
"""--n, --max-prompts, --max-response-len on a CPU when neither the flag nor --config / an override sets
them: minutes for a 135M model on 2 cores (on a loaded machine, a random-weight model of SmolLM2-135M's
shape took 78 s for 32 prompts x 4 x 48 tokens, every response to the limit), where the paper's 32 samples of
up to 20480 tokens per prompt take days."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="HF folder or Megatron checkpoint (folder)")
    p.add_argument("--data", required=True, help="dataset file or builtin:... spec")
    gpu = Config()

    def default(key: str, on_gpu: Any) -> str:
        return f"(default: {key} if --config or an override sets it, else {CPU_DEFAULTS[key]} on CPU, " \
               f"{on_gpu} on GPU)"

    p.add_argument("--n", type=int, help="samples per prompt, k of avg@k "
                   + default("eval.n_samples", gpu.eval.n_samples))
    p.add_argument("--temperature", type=float, help="default eval.temperature (1.0)")
    p.add_argument("--top-p", type=float, help="default eval.top_p (0.7)")
    p.add_argument("--max-prompts", type=int, help="evaluate the first N prompts only "
                   + default("eval.max_prompts", gpu.eval.max_prompts or "all"))
    p.add_argument("--max-response-len", type=int, help="response token limit "
                   + default("rollout.max_response_len", gpu.rollout.max_response_len))
    p.add_argument("--engine", choices=("embedded", "sglang"), help="default rollout.engine (embedded)")
    p.add_argument("--seed", type=int, help="sampling seed (default train.seed)")
    p.add_argument("--out", type=Path,
                   help="per-prompt jsonl (default runs/eval/<run>-<step_N|hf_final>.jsonl, or <folder>.jsonl)")
    p.add_argument("--config", help="YAML config whose data / model / reward / eval settings apply")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.prompt_template=dapo_math")
    return p


def resolve_config(args: argparse.Namespace, *, on_gpu: bool | None = None) -> Config:
    """CPU_DEFAULTS (on a CPU), then --config + overrides, then the flags; the overlong term is off
    (evaluation scores answers). `on_gpu`: None = whether CUDA is available."""
    flags = {"eval.n_samples": args.n, "eval.temperature": args.temperature, "eval.top_p": args.top_p,
             "eval.max_prompts": args.max_prompts, "rollout.max_response_len": args.max_response_len,
             "rollout.engine": args.engine, "train.seed": args.seed}
    overrides = [*args.overrides, "reward.soft_overlong_punishment=false", f"data.val_path={args.data}",
                 *(f"{k}={v}" for k, v in flags.items() if v is not None)]
    try:
        sized = cpu_sized(args.config, overrides, on_gpu)
        return load_config(args.config, [*(f"{k}={v}" for k, v in sized.items()), *overrides])
    except ConfigError as e:
        raise UserError(str(e)) from e


def cpu_sized(config: str | None, overrides: list[str], on_gpu: bool | None = None) -> dict[str, int]:
    """The CPU_DEFAULTS that apply: none on a GPU, else those that neither `config` nor `overrides` set."""
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    if on_gpu:
        return {}
    given = set()
    if config is not None and Path(config).is_file():  # (a missing file: load_config says so)
        given = _dotted_keys(read_yaml(Path(config)) or {})
    given |= {o.split("=", 1)[0].strip() for o in overrides}
    return {k: v for k, v in CPU_DEFAULTS.items() if k not in given}


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    if not isinstance(tree, dict):
        return {prefix[:-1]} if prefix else set()
    return {k for name, sub in tree.items() for k in _dotted_keys(sub, f"{prefix}{name}.")}


@dataclass
class GroupProgress:
    """The progress callback: one step of `bar` per finished prompt, generated tokens per second beside it."""

    bar: Any
    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0

    def __call__(self, group: Any) -> None:
        self.tokens += sum(s.response_len for s in group.samples)
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tok/s" if elapsed > 0 else "", refresh=False)
        self.bar.update(1)


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@contextlib.contextmanager
def hf_model(path: Path) -> Iterator[tuple[Path, Path]]:
    """(HF folder, what it is): `path` itself for an HF folder; a Megatron checkpoint (the newest complete
    step_<N>/ of a run folder) converted to a temporary HF folder."""
    if is_hf_folder(path):
        yield path, path
        return
    from megatron_dapo.actor import convert
    from megatron_dapo.actor.convert_checks import resolve_checkpoint

    if not path.is_dir():
        raise UserError(f"--model {path}: no such folder")
    ckpt = resolve_checkpoint(path, flag="--model")
    with tempfile.TemporaryDirectory(prefix="dapo-eval-") as tmp:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the summary line only
            cfg = convert.ToHF(load=ckpt, save=Path(tmp) / "hf", quiet=True)
            plan = convert.prepare_to_hf(cfg, PROG)
            print(f"{PROG}: converting the Megatron checkpoint {plan.ckpt} to Hugging Face format")
            code = convert.megatron_to_hf(cfg, plan, PROG)
        if code != 0:
            raise UserError(f"--model {path}: conversion failed")
        yield plan.out, ckpt


def default_out(evaluated: Path) -> Path:
    """runs/eval/<run>-<what>.jsonl for a run's hf_final or step_<N> (each run and step its own file), else
    runs/eval/<folder>.jsonl."""
    from megatron_dapo.actor.checkpoint import step_of

    target = evaluated.resolve()
    if target.name == "hf_final" or step_of(target) is not None:
        return Path("runs") / "eval" / f"{target.parent.name}-{target.name}.jsonl"
    return Path("runs") / "eval" / f"{target.name}.jsonl"


@contextlib.contextmanager
def open_engine(cfg: Config, hf_dir: Path) -> Iterator[Any]:
    import torch

    if cfg.rollout.engine == "sglang":
        from megatron_dapo.rollout.sglang.fleet import start_job_servers

        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        servers = start_job_servers(hf_dir, cfg.rollout.sglang, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                                    dtype=dtype)
        try:
            yield servers.engine
        finally:
            servers.shutdown()
        return
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    gpu = torch.cuda.is_available()
    engine = EmbeddedEngine(hf_dir, device="cuda" if gpu else "cpu", dtype=torch.bfloat16 if gpu else torch.float32)
    try:
        yield engine
    finally:
        engine.shutdown()


@contextlib.contextmanager
def with_tool(cfg: Config, engine: Any, tokenizer: Any, eos: tuple[int, ...]) -> Iterator[Any]:
    """`engine`, multi-turn with rollout.tools when a tool is configured (as the training rollouts)."""
    if not cfg.rollout.tools.enabled:
        yield engine
        return
    from megatron_dapo.rollout.tools import ToolLoadError, with_tools
    from megatron_dapo.sandbox import SandboxUnavailable

    try:
        wrapped = with_tools(engine, cfg.rollout.tools, tokenizer, eos)
    except (SandboxUnavailable, ToolLoadError) as e:
        raise UserError(str(e)) from None
    print(f"{PROG}: multi-turn with tool {cfg.rollout.tools.name}, at most {cfg.rollout.tools.max_calls} calls "
          "a sample", file=sys.stderr)
    try:
        yield wrapped
    finally:
        wrapped.shutdown()


def load_eval_prompts(cfg: Config) -> list[Any]:
    from megatron_dapo.data import PromptFormat, load_prompts

    d = cfg.data
    try:
        fmt = PromptFormat.from_files(d.prompt_template, d.system_prompt, d.few_shot_path)
        loaded = load_prompts(d.val_path, max_prompt_chars=d.max_prompt_chars, limit=cfg.eval.max_prompts,
                              prompt_format=fmt)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    print(f"{PROG}: {loaded.summary()}", file=sys.stderr)
    if not loaded.prompts:
        raise UserError(f"--data {d.val_path}: no usable prompt")
    return loaded.prompts


def run(cfg: Config, hf_dir: Path) -> Any:
    """Generate and score with a progress bar; returns the EvalResult."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from megatron_dapo.data.render import use_chat_template
    from megatron_dapo.loop.evaluation import EvalResult, generate_and_score
    from megatron_dapo.reward import RewardLoadError, Scorer
    from megatron_dapo.collect.seeds import sampling_params

    try:
        scorer = Scorer(cfg.reward, cfg.rollout.max_response_len)
    except RewardLoadError as e:
        raise UserError(str(e)) from e
    prompts = load_eval_prompts(cfg)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    print(f"{PROG}: chat template: {use_chat_template(tokenizer, cfg.model.chat_template)}", file=sys.stderr)
    print(f"{PROG}: {len(prompts)} prompts x {cfg.eval.n_samples} samples, responses up to "
          f"{cfg.rollout.max_response_len} tokens", file=sys.stderr)
    eos = eos_ids(tokenizer)
    t0 = time.perf_counter()
    with open_engine(cfg, hf_dir) as plain, with_tool(cfg, plain, tokenizer, eos) as engine, \
            tqdm(total=len(prompts), desc="evaluate", unit="prompt", file=sys.stderr, dynamic_ncols=True,
                 mininterval=0) as bar:
        groups = generate_and_score(engine, tokenizer, prompts, cfg.eval.n_samples,
                                    lambda i: sampling_params(cfg, eos, "eval", i), scorer, on_group=GroupProgress(bar))
    return EvalResult(groups, cfg.eval.n_samples, seconds=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    quiet_third_party()
    cfg = resolve_config(args)
    with hf_model(args.model) as (hf_dir, evaluated):
        print(f"{PROG}: evaluating {evaluated}", file=sys.stderr)
        result = run(cfg, hf_dir)
    out = args.out or default_out(evaluated)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in result.prompt_records())
    summary = {"model": str(args.model), "evaluated": str(evaluated), "data": cfg.data.val_path,
               "n": cfg.eval.n_samples,
               "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
               "max_response_len": cfg.rollout.max_response_len, **result.summary(),
               "seconds": round(result.seconds, 3), "per_prompt": str(out)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    from megatron_dapo.actor.convert_checks import USER_ERRORS

    sys.exit(run_cli(PROG, main, user_errors=USER_ERRORS))

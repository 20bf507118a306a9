"""Helpers several test modules share (test modules never import one another): running the trainer, reading
how it ended, fake checkpoints, a failing rollout engine, random loss batches and answer wrappers.
Fixtures live in conftest.py."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.metrics import read_scalars
from megatron_dapo.rollout.base import AbortReport, GroupResult, RolloutEngine, RolloutStream, SamplingParams
from megatron_dapo.types import Sample

REPO = Path(__file__).resolve().parents[1]

# ---- the trainer, run as `python -m megatron_dapo.train` on the tiny base ---------------------------------

TAGS = [
    "train/reward_mean", "train/acc_mean", "response_length/mean", "response_length/max",
    "response_length/clip_ratio", "actor/entropy", "actor/mean_token_prob", "actor/pg_loss",
    "actor/clipfrac_high", "actor/clipfrac_low", "actor/grad_norm", "actor/lr", "rollout/gen_rounds",
    "rollout/kept_group_frac", "rollout/train_rollout_logprob_absdiff", "val/acc_avg_at_k",
    "timing/rollout_s", "timing/reward_s", "timing/old_logprob_s", "timing/update_s", "timing/weight_sync_s",
    "timing/step_s", "perf/tokens_per_s", "perf/weight_sync_bytes", "perf/weight_sync_bytes_sent_rank0",
    "perf/weight_sync_bytes_cross_node", "perf/rollout_bytes_total",
    "perf/rollout_bytes_max_recv", "memory/actor_bytes_generate", "memory/actor_bytes_train", "memory/actor_bytes_sync",
    "memory/engine_bytes_generate", "memory/engine_bytes_train", "memory/engine_bytes_sync",
    "memory/actor_asleep_in_generate",
    "val/pass_at_k", "val/maj_at_k", "val/response_length_mean", "timing/eval_s", "perf/rollout_tokens_per_s",
    "reward/failures", "alarm/no_correct_answers", "perf/pad_frac", "perf/trained_tokens", "perf/prefix_saved_frac",
    "perf/output_tokens", "rollout/engine_restarts", "rollout/resubmitted_groups",
]
"""Every monitor a CPU run writes."""
TOOL_TAGS = ["tool/calls_per_sample", "tool/error_frac", "tool/timeout_frac", "tool/seconds", "rollout/turns_mean",
             "rollout/void_turn_frac", "rollout/observation_token_frac"]
"""The monitors a run with rollout.tools adds (none of them in a single-turn run)."""
# The test base is trained for seconds and may answer nothing right on a busy machine: the paper's accuracy
# filter would then keep no group (no update, no actor/* monitors); the score filter keeps length-shaped ones.
SMALL = ["train.prompt_batch_size=8", "train.mini_batch_size=4", "algo.group_size=4", "eval.n_samples=2",
         "eval.max_prompts=16", "eval.every_steps=2", "train.deterministic=true", "algo.filter_metric=score"]


def train_cmd(base_dir, root, run, *extra):
    return [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
            f"model.hf_dir={base_dir}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
            f"logging.run_name={run}", *SMALL, *extra]


def run_train(cmd, env, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-6000:]
    return r


def run(cmd, env, timeout=600):
    """`cmd`'s result whatever its exit status."""
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def launch_plan(worker: Path, nproc: int, entries: list[dict], env: dict, timeout: float = 600) -> list[list[dict]]:
    """Several runs of a torchrun worker (`worker plan PLAN_JSON`; tests/workers/actor_worker.py's run_plan) in one
    launch of `nproc` ranks; each entry's "out" folder gets its rank_<i>.pt. Returns each entry's results by rank."""
    import json

    from megatron_dapo.parallel import free_port

    for e in entries:
        Path(e["out"]).mkdir(parents=True, exist_ok=True)
    plan = Path(entries[0]["out"]).parent / f"plan_{Path(entries[0]['out']).name}.json"
    plan.write_text(json.dumps([{k: str(v) if isinstance(v, Path) else v for k, v in e.items()} for e in entries]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(worker), "plan", str(plan)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return [[torch.load(Path(e["out"]) / f"rank_{i}.pt", weights_only=False) for i in range(nproc)] for e in entries]


def error_lines(stderr: str) -> list[str]:
    """stderr without log records (and their indented continuation lines, e.g. the start-up summary) and
    progress bars: what the user is told."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln[:4].isdigit() and not ln.startswith("dapo:")
            and not ln.startswith("  ")
            and "UserWarning" not in ln and "warnings.warn" not in ln]


def one_line(r, code: int, *needles: str) -> str:
    """Asserts the run exited with `code`, told the user one line (holding every needle) and no traceback."""
    lines = error_lines(r.stderr)
    assert r.returncode == code, (r.returncode, r.stderr[-4000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-4000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def logged_steps(tb: Path) -> set[int]:
    """The steps a (perhaps live) run has logged so far."""
    try:
        return set(read_scalars(tb).get("train/reward_mean", {}))
    except Exception:  # noqa: BLE001 - an event file being written
        return set()


# ---- stopping a job from outside ------------------------------------------------------------------------


def kill_job_at(cmd: list[str], env: dict, marker: Path, timeout: float = 300) -> None:
    """Start `cmd` and SIGKILL its whole process group once `marker` exists (or the run ends or times out),
    as a node failure or scancel does: the trainer alone would leave its helpers (multiprocessing's
    resource tracker, a writer process mid-save) orphaned."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def wait_for(predicate, proc, timeout=400):
    deadline = time.time() + timeout
    while not predicate() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert predicate(), f"never happened (exit {proc.poll()})"


def signal_job(proc: subprocess.Popen, sig: int) -> list[str]:
    """Send `sig` as Slurm does (scancel, the time limit, what srun forwards): to every process of the job.
    `proc` leads its own process group (start_new_session): the group gets it, and so does every descendant
    that left it (a server in its own session). Returns the command lines signalled besides `proc`'s."""
    import psutil

    others = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, sig)
    for child in others:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(child.pid) != proc.pid:
                os.kill(child.pid, sig)
    names = []
    for child in others:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(child.cmdline()))
    return names


# ---- a checkpoint folder without an actor ---------------------------------------------------------------


def fake_checkpoint(root: Path, step: int) -> Path:
    """A complete, verified step folder of small made-up files under `root`."""
    from megatron_dapo.actor.checkpoint import step_dir
    from megatron_dapo.actor.checkpoint_files import write_json, write_manifest

    path = step_dir(root, step)
    (path / "rng").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (path / ".metadata").write_bytes(b"meta" * 10)
    (path / "rng" / "rank_0.safetensors").write_bytes(b"r" * 100)
    write_json(path / "trainer_state.json", {"step": step})
    write_manifest(path)
    (path / "COMPLETE").write_text(str(step))
    return path


# ---- a generate aborted from another thread -------------------------------------------------------------


def abort_a_running_generate(engine: RolloutEngine, prompts, limit_s: float,
                             poll_s: float) -> list[BaseException]:
    """Runs a long generate in a thread and calls engine.abort() until it returns (an abort before generate
    has started is, by design, a no-op); returns what the generate raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            engine.generate(prompts, 2, SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=0))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + limit_s
    while thread.is_alive() and time.monotonic() < deadline:
        engine.abort()
        thread.join(timeout=poll_s)
    assert not thread.is_alive(), f"generate still running {limit_s} s after the first abort"
    return errors


# ---- a rollout engine that fails ------------------------------------------------------------------------


class FailingStream(RolloutStream):
    """Delivers `good` groups (of two 2-token samples), then fails."""

    def __init__(self, good: int) -> None:
        self.keys: list[int] = []
        self.good, self.aborted = good, False

    @property
    def pending(self) -> int:
        return len(self.keys)

    def submit(self, requests):
        self.keys += [r.key for r in requests]

    def next(self):
        if self.good == 0:
            raise RuntimeError("connection refused")
        self.good -= 1
        samples = [Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[0.0, 0.0], finish_reason="stop")
                   for _ in range(2)]
        return GroupResult(key=self.keys.pop(0), samples=samples)

    def abort(self):
        keys, self.keys, self.aborted = self.keys, [], True
        return AbortReport(keys=sorted(keys), tokens=0)


class FailingEngine(RolloutEngine):
    """Each stream it opens is a FailingStream(good); `streams` keeps them."""

    def __init__(self, good: int) -> None:
        self.streams: list[Any] = []
        self.good = good

    def stream(self):
        self.streams.append(FailingStream(self.good))
        return self.streams[-1]

    generate = update_weights = sleep = wake = abort = shutdown = lambda self, *a: None  # type: ignore[assignment]
    health = lambda self: True  # noqa: E731


# ---- the policy loss ------------------------------------------------------------------------------------


def random_batch(seed: int, B: int = 11, T: int = 37):
    """(logprobs, old_logprobs, advantages, mask) in float64; row 3 fully masked (e.g. overlong-filtered)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    noise = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3  # large enough to hit both clips
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[3] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return old + noise, old, adv, mask


def global_kwargs(mode: str, mask: torch.Tensor) -> dict:
    """policy_loss's normaliser for the whole batch `mask` under loss aggregation `mode`."""
    if mode == "token-mean":
        return {"global_num_tokens": int(mask.sum())}
    return {"global_num_seqs": int((mask.sum(-1) > 0).sum())}


# ---- answers as models write them -----------------------------------------------------------------------

# (opening, closing) pairs that wrap an answer, composed at random by fuzz tests; math mode is entered once.
WRAPS = [("\\mathbf{", "}"), ("\\textbf{", "}"), ("\\text{", "}"), ("\\mathrm{", "}"), ("\\boxed{", "}"),
         ("\\fbox{", "}"), ("**", "**"), ("", "\\%"), ("", "%")]
MATH = [("\\(", "\\)"), ("\\[", "\\]"), ("$", "$"), ("$$", "$$")]


# ---- what a config reads, as tiny stand-ins (the trainer's --dry-run refuses a missing model or dataset) ---------


def stand_in_32b(root: Path) -> Path:
    """What examples/configs/dapo_qwen2.5_32b.yaml reads, tiny, under `root`: models/Qwen2.5-32B (a Qwen2 with 8
    heads, so TP=8 divides it, and the character tokenizer), data/dapo-math-17k.parquet (one batch of 512
    DAPO-Math rows) and data/aime-2024.parquet. Returns `root`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_dapo.tiny import save_tiny_model
    from megatron_dapo.tiny.tokenizer import build_char_tokenizer, save_tokenizer

    model = save_tiny_model(root / "models" / "Qwen2.5-32B", "qwen2", num_attention_heads=8, num_key_value_heads=8)
    save_tokenizer(build_char_tokenizer(), model)
    (root / "data").mkdir(parents=True, exist_ok=True)
    for name, n in (("dapo-math-17k", 512), ("aime-2024", 30)):
        rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 7? Answer: <n>"}], "data_source": name,
                 "reward_model": {"ground_truth": str(i + 7)}} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{name}.parquet")
    return root


def forward_routes(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers MoE model's routing of `ids` in one forward (no cache, no padding, no batch): ([tokens, layers, k]
    the routers' picks, [tokens, layers] the gap between the k-th and k+1-th probability)."""
    picks, gaps, hooks = [], [], []

    def hook(_m, _i, out):
        probs = out[0].float().softmax(-1).sort(-1, descending=True).values
        picks.append(out[2])
        gaps.append(probs[:, _m.top_k - 1] - probs[:, _m.top_k])

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(picks, 1), torch.stack(gaps, 1)

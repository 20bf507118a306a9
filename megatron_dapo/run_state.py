"""Everything a DAPO run holds between steps (actor, engine, data, metrics, checkpoints), so that
train.py reads as the algorithm. Rank 0 is the rollout driver; all ranks train."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor, LossSettings
from megatron_dapo.actor.batching import split_rows
from megatron_dapo.actor.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_dapo.algo.train_batch import build_train_batch
from megatron_dapo.config import Config, to_dict
from megatron_dapo.data import PromptIterator, load_prompts
from megatron_dapo.metrics import Alarms, MetricsWriter
from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
from megatron_dapo.rollout.collect import StepRollout, generate_groups, score_group
from megatron_dapo.rollout.weight_sync import sync_weights
from megatron_dapo.types import Group, Prompt, TrainBatch

log = logging.getLogger("megatron_dapo.train")


class SetupError(RuntimeError):
    """A run cannot start (missing model, empty dataset): reported without a traceback."""


def step_sampling(cfg: Config, step: int, round_idx: int, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Training-rollout sampling; the seed is a pure function of (seed, step, round) so resumes replay."""
    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          max_new_tokens=cfg.rollout.max_response_len, stop_token_ids=eos_ids,
                          seed=_seed(cfg.train.seed, "train", step, round_idx))


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class RunState:
    cfg: Config
    actor: Actor
    tokenizer: Any
    engine: RolloutEngine | None
    prompts: PromptIterator | None
    val_prompts: list[Prompt]
    writer: MetricsWriter
    alarms: Alarms
    ckpt_root: Path
    hf_dir: str
    start_step: int = 0
    samples_generated: int = 0
    servers: list[Any] = field(default_factory=list)
    """SGLang: servers this rank started for rank 0 to drive (a node leader's); finish() stops them."""
    _times: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _bar: Any = None

    # --- layout -----------------------------------------------------------------------------------

    @property
    def is_driver(self) -> bool:
        return parallel.is_main()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def target_groups(self) -> int:
        return self.cfg.train.prompt_batch_size

    @property
    def num_mini_batches(self) -> int:
        return self.cfg.train.prompt_batch_size // self.cfg.train.mini_batch_size

    def next_prompts(self, k: int) -> list[Prompt]:
        return [p for _ in range(k) for p in self.prompts.next_batch()]

    def broadcast(self, obj: Any) -> Any:
        if parallel.world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def trainable(self, groups: list[Group]) -> list[Group]:
        """Trim a (partial) batch to whole mini-batches that split evenly over DP ranks."""
        unit = parallel.dp_size() * self.num_mini_batches
        return groups[: len(groups) // unit * unit]

    def local_batch(self, groups: list[Group]) -> TrainBatch:
        batch = build_train_batch(groups, overlong_filtering=self.cfg.algo.overlong_filtering,
                                  pad_id=self.tokenizer.pad_token_id or 0)
        return split_rows(batch, parallel.dp_size())[parallel.dp_rank()]

    # --- colocation ---------------------------------------------------------------------------------

    def engine_sleep(self) -> None:
        if self.engine is not None and self.cfg.rollout.colocate:
            self.engine.sleep()
        self.actor.wake()

    def sync_weights(self) -> None:
        if self.engine is not None and self.cfg.rollout.colocate:
            self.engine.wake()
        stats = sync_weights(self.actor.module, self.actor.spec, self.engine)
        self._times["weight_sync_bytes"] = stats.bytes
        if self.cfg.rollout.colocate:
            self.actor.sleep()
            self.actor.wake()  # CPU: no-op pair; GPU: the actor's memory was free during the rollout

    # --- metrics --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def timer(self, name: str):
        t0 = time.perf_counter()
        yield
        self._times[name] += time.perf_counter() - t0

    def timings(self, t_step: float, tokens: int = 0) -> dict[str, float]:
        step_s = time.perf_counter() - t_step
        out = {f"timing/{k}_s": v for k, v in self._times.items() if k != "weight_sync_bytes"}
        if "weight_sync_bytes" in self._times:
            out["perf/weight_sync_bytes"] = self._times["weight_sync_bytes"]
        out["timing/step_s"] = step_s
        out["perf/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
        self._times.clear()
        return out

    def rollout_scalars(self, rollout: StepRollout) -> dict[str, float]:
        samples = [s for g in rollout.generated for s in g.samples]
        self._times["rollout"] -= rollout.reward_seconds
        self._times["reward"] += rollout.reward_seconds
        lengths = [s.response_len for s in samples]
        self.samples_generated += len(samples)
        return {"rollout/samples_total": float(self.samples_generated),
                "train/reward_mean": _mean([s.reward for s in samples]),
                "train/acc_mean": _mean([float(s.acc) for s in samples]),
                "response_length/mean": _mean(lengths), "response_length/max": float(max(lengths, default=0)),
                "response_length/clip_ratio": _mean([float(s.truncated) for s in samples]),
                "rollout/gen_rounds": float(rollout.stats.rounds),
                "rollout/kept_group_frac": rollout.stats.kept_frac,
                "rollout/groups_trained": float(len(self.trainable(rollout.groups))),
                "rollout/exhausted": float(rollout.stats.exhausted)}

    def update_scalars(self, update: dict[str, float], batch: TrainBatch, entropy: torch.Tensor,
                       groups: list[Group]) -> dict[str, float]:
        gen = batch.response_mask
        sums = torch.tensor([float((entropy * gen).sum()), float((batch.rollout_logprobs.exp() * gen).sum()),
                             float(((batch.old_logprobs - batch.rollout_logprobs).abs() * gen).sum()),
                             float(gen.sum())], dtype=torch.float64)
        if parallel.dp_size() > 1:
            dist.all_reduce(sums, group=parallel.dp_group())
        ent, prob, diff, n = sums.tolist()
        n = max(n, 1.0)
        return {"actor/pg_loss": update["loss"], "actor/clipfrac_high": update["clipfrac_high"],
                "actor/clipfrac_low": update["clipfrac_low"], "actor/grad_norm": update["grad_norm"],
                "actor/lr": update["lr"], "actor/approx_kl": update["approx_kl"],
                "actor/nonfinite": update["nonfinite"], "actor/entropy": ent / n, "actor/mean_token_prob": prob / n,
                "rollout/train_rollout_logprob_absdiff": diff / n}

    def write(self, step: int, scalars: dict[str, float]) -> None:
        scalars = {**scalars, **self.alarms.check(scalars)}
        self.writer.write(step, scalars)
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in scalars.items()
                                   if k in ("train/acc_mean", "val/acc_avg_at_k", "actor/entropy")})

    def progress(self, steps: range):
        if not self.is_driver:
            return steps
        from tqdm import tqdm

        self._bar = tqdm(steps, desc="dapo", unit="step", initial=0, total=len(steps), dynamic_ncols=True)
        return self._bar

    # --- evaluation and checkpoints ---------------------------------------------------------------------

    def budget_spent(self) -> bool:
        budget = self.cfg.train.rollout_budget
        return budget > 0 and self.samples_generated >= budget

    def wants_eval(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return bool(self.val_prompts) and every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def evaluate(self) -> dict[str, float]:
        """avg@k: mean accuracy over k samples per validation prompt (eval temperature / top-p)."""
        if not self.is_driver:
            return {}
        e = self.cfg.eval
        sampling = SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=self.cfg.rollout.max_response_len,
                                  stop_token_ids=self.eos_ids, seed=_seed(self.cfg.train.seed, "eval"))
        groups = generate_groups(self.engine, self.tokenizer, self.val_prompts, e.n_samples, sampling)
        for g in groups:
            score_group(g, self.tokenizer, self.cfg.reward, self.cfg.rollout.max_response_len)
        samples = [s for g in groups for s in g.samples]
        return {"val/acc_avg_at_k": _mean([float(s.acc) for s in samples]),
                "val/response_length_mean": _mean([s.response_len for s in samples])}

    def wants_checkpoint(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return (every > 0 and step % every == 0) or step == self.cfg.train.steps

    def save(self, step: int) -> None:
        state = {"data": self.prompts.state_dict() if self.prompts else None, "alarms": self.alarms.state_dict(),
                 "samples_generated": self.samples_generated, "config": to_dict(self.cfg)}
        save_checkpoint(self.actor, self.ckpt_root, step, trainer_state=state, keep_last=self.cfg.checkpoint.keep_last,
                        hf_dir=self.hf_dir)

    def finish(self) -> None:
        if self.cfg.checkpoint.export_hf:
            from megatron_dapo.actor.hf_io import save_hf_checkpoint

            out = save_hf_checkpoint(self.actor.module, self.actor.spec, self.ckpt_root / "hf_final", self.hf_dir)
            if self.is_driver:
                log.info("exported the final policy in Hugging Face format to %s", out)
        png = self.writer.summary_png()
        if png is not None:
            log.info("dynamics summary: %s", png)
        self.writer.close()
        if self._bar is not None:
            self._bar.close()
        if self.engine is not None:
            self.engine.shutdown()
        for server in self.servers:
            server.shutdown()


def build_run(cfg: Config) -> RunState:
    """Initialise processes, actor, engine, data and metrics; resume if a checkpoint is found."""
    from transformers import AutoTokenizer

    parallel.initialize(cfg.parallel, seed=cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    hf_dir = cfg.model.hf_dir
    if not hf_dir or not (Path(hf_dir) / "config.json").is_file():
        raise SetupError(f"model.hf_dir={hf_dir!r} has no config.json (for the tiny CPU run, build it with "
                                "`python tools/make_tiny_base.py --out checkpoints/tiny_base`)")
    loss = LossSettings.from_algo(cfg.algo, temperature=cfg.rollout.temperature)
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor, loss)
    if cfg.model.load:
        load_checkpoint(actor, cfg.model.load, load_optimizer=False, load_rng=False)
    driver = parallel.is_main()
    servers = _start_sglang(cfg, hf_dir) if cfg.rollout.engine == "sglang" else None
    engine = servers.engine if servers is not None else _embedded_engine(hf_dir) if driver else None
    run = RunState(
        cfg=cfg, actor=actor, tokenizer=AutoTokenizer.from_pretrained(hf_dir), engine=engine,
        prompts=_train_prompts(cfg) if driver else None,
        val_prompts=_val_prompts(cfg) if driver else [],
        writer=MetricsWriter(Path(cfg.logging.tensorboard_dir) / cfg.logging.run_name, enabled=driver),
        alarms=Alarms(cfg.logging, cfg.rollout.max_response_len),
        ckpt_root=Path(cfg.checkpoint.dir) / cfg.logging.run_name, hf_dir=hf_dir,
        servers=servers.owned if servers is not None else [])
    _maybe_resume(run)
    if run.start_step > 0 or cfg.model.load:
        run.sync_weights()  # the engine started from hf_dir; give it the trained weights
    return run


def _start_sglang(cfg: Config, hf_dir: str):
    """Every rank: node leaders start SGLang servers; global rank 0 gets the engine over all of them."""
    from megatron_dapo.actor.model import param_dtype
    from megatron_dapo.rollout.sglang.fleet import start_job_servers

    # the actor's dtype, not SGLang's "auto" (which serves a float32 checkpoint in float16)
    dtype = str(param_dtype(cfg.model)).removeprefix("torch.")
    return start_job_servers(hf_dir, cfg.rollout.sglang, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                             dtype=dtype)


def _embedded_engine(hf_dir: str) -> RolloutEngine:
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(hf_dir)


def _load(path: str, **kw: Any):
    try:
        return load_prompts(path, **kw)
    except (FileNotFoundError, ValueError) as e:
        raise SetupError(str(e)) from e


def _train_prompts(cfg: Config) -> PromptIterator:
    loaded = _load(cfg.data.train_path, max_prompt_chars=cfg.data.max_prompt_chars)
    log.info("training prompts: %s", loaded.summary())
    if not loaded.prompts:
        raise SetupError(f"data.train_path={cfg.data.train_path!r}: no usable prompt ({loaded.summary()})")
    return PromptIterator(loaded.prompts, batch_size=1, seed=cfg.train.seed, shuffle=cfg.data.shuffle)


def _val_prompts(cfg: Config) -> list[Prompt]:
    if not cfg.data.val_path:
        return []
    loaded = _load(cfg.data.val_path, max_prompt_chars=cfg.data.max_prompt_chars, limit=cfg.eval.max_prompts)
    log.info("validation prompts: %s", loaded.summary())
    return loaded.prompts


def _maybe_resume(run: RunState) -> None:
    resume = run.cfg.checkpoint.resume
    path = latest_checkpoint(run.ckpt_root) if resume == "auto" else None if resume == "none" else Path(resume)
    if path is None:
        return
    extra = load_checkpoint(run.actor, path)
    trainer = extra.get("trainer", {})
    if run.prompts is not None and trainer.get("data"):
        run.prompts.load_state_dict(trainer["data"])
    run.alarms.load_state_dict(trainer.get("alarms", {}))
    run.samples_generated = int(trainer.get("samples_generated", 0))
    run.start_step = int(extra["step"])
    run.writer.load_history(run.start_step)
    if run.is_driver:
        log.info("resumed from %s (step %d)", path, run.start_step)

"""What a DAPO run holds between steps, and its life cycle: build (processes, actor, engine, data,
metrics), resume, save, finish. Rank 0 is the rollout driver; every rank trains its actor shard."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_dapo.actor.model import UnsupportedModelError, param_dtype
from megatron_dapo.algo.policy_losses import policy_loss_spec
from megatron_dapo.cli import preflight_error
from megatron_dapo.config import Config, ModelConfig, to_dict
from megatron_dapo.config.ranges import may_change_on_resume
from megatron_dapo.data import PromptFormat, PromptIterator
from megatron_dapo.data.render import default_system_prompt, use_chat_template
from megatron_dapo.hf_files import HFCheckpointError
from megatron_dapo.loop import run_dir
from megatron_dapo.loop.evaluation import sample_records
from megatron_dapo.loop.old_policy import OldLogprobSource, resolve_old_logprob_source
from megatron_dapo.loop.phases import Phases
from megatron_dapo.loop.pipeline import RolloutPipeline
from megatron_dapo.loop.preflight import SetupError, check_model, checkpoint_bytes
from megatron_dapo.loop.prompts import load_train_prompts, load_val_prompts
from megatron_dapo.loop.startup import StartupReport, system_prompt_note
from megatron_dapo.loop.weight_probe import WeightProbe
from megatron_dapo.loop.stream import carry_state, load_carry
from megatron_dapo.metrics import Alarms, MetricsWriter, PhaseTimer
from megatron_dapo.reward import RewardLoadError, Scorer
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.stop_signals import helpers_shielded
from megatron_dapo.types import Group, Prompt
from megatron_dapo.wandb_mirror import import_wandb

log = logging.getLogger(__name__)


__all__ = ["RunState", "SetupError", "build_run", "config_changes", "load_train_prompts", "load_val_prompts"]
_DEFAULTS = Config()  # the tree whose fields say what a resumed run may change


@dataclass
class RunState:
    cfg: Config
    actor: Actor
    tokenizer: Any
    engine: RolloutEngine | None
    """The rollout engine over every server of the job: global rank 0 (the driver) only."""
    phases: Phases
    prompts: PromptIterator | None
    val_prompts: list[Prompt]
    writer: MetricsWriter
    alarms: Alarms
    ckpt_root: Path
    hf_dir: str
    scorer: Scorer
    """reward.name's verifier + the overlong term, built once (the driver scores)."""
    old_logprobs: OldLogprobSource
    """Where pi_old comes from (algo.old_logprob_source, auto resolved at start-up)."""
    start_step: int = 0
    samples_generated: int = 0
    carry: list = field(default_factory=list)
    """Partial rollout: the groups the last step aborted, continued by the next (loop/stream.py)."""
    servers: list[Any] = field(default_factory=list)
    """SGLang: servers this rank started for rank 0 to drive (a node leader's); finish() stops them."""
    lock: run_dir.RunLock | None = None
    """The run folder's lock (rank 0); released by close()."""
    last_saved: int | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    pipeline: RolloutPipeline | None = None
    """rollout.async_steps > 0: the driver's producer of the next batch (loop/pipeline.py)."""
    has_val: bool = False
    """The driver loaded validation prompts; every rank knows it (validation moves the devices collectively)."""

    @property
    def is_driver(self) -> bool:
        return parallel.is_main()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def num_mini_batches(self) -> int:
        return self.cfg.train.prompt_batch_size // self.cfg.train.mini_batch_size

    def next_prompts(self, k: int) -> list[Prompt]:
        return [p for _ in range(k) for p in self.prompts.next_batch()]

    # --- schedule -----------------------------------------------------------------------------------

    def budget_spent(self) -> bool:
        budget = self.cfg.train.rollout_budget
        return budget > 0 and self.samples_generated >= budget

    def wants_eval(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return self.has_val and every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def wants_samples(self, step: int) -> bool:
        every = self.cfg.logging.samples_every
        return every > 0 and step % every == 0

    def write_samples(self, step: int, split: str, groups: list[Group]) -> None:
        """Driver: a few responses of `groups` to samples/step_<k>.jsonl and TensorBoard text (val: at
        every evaluation; train: every logging.samples_every steps)."""
        if not self.is_driver or (split == "train" and not self.wants_samples(step)):
            return
        records = sample_records(groups, self.tokenizer, self.cfg.logging.samples_per_step, step, split)
        self.writer.write_samples(step, split, records)

    def wants_checkpoint(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return (every > 0 and step % every == 0) or step == self.cfg.train.steps

    # --- checkpoints and the end ----------------------------------------------------------------------

    def save(self, step: int) -> None:
        state = {"data": self.prompts.state_dict() if self.prompts else None, "alarms": self.alarms.state_dict(),
                 "samples_generated": self.samples_generated, "config": to_dict(self.cfg),
                 "carry": carry_state(self.carry),
                 "pending": self.pipeline.state_dict() if self.pipeline is not None else None}
        self.phases.train()  # the actor's state on its device (it may sleep through the rollout)
        with helpers_shielded():  # megatron-core's writer processes (and, once, their Manager) start here
            save_checkpoint(self.actor, self.ckpt_root, step, trainer_state=state,
                            keep_last=self.cfg.checkpoint.keep_last, hf_dir=self.hf_dir)
        self.last_saved = step

    def resume(self, path: Path | None) -> None:
        """Continue from the checkpoint run_dir.claim chose (None: start from scratch)."""
        if path is None:
            return
        extra = load_checkpoint(self.actor, path, verify=False)  # claim() verified it
        trainer = extra.get("trainer", {})
        if self.prompts is not None and trainer.get("data"):
            self.prompts.load_state_dict(trainer["data"])
        self.alarms.load_state_dict(trainer.get("alarms", {}))
        self.samples_generated = int(trainer.get("samples_generated", 0))
        self.carry = load_carry(trainer.get("carry", [])) if self.cfg.rollout.partial_rollout else []
        if self.pipeline is not None:
            self.pipeline.load_state_dict(trainer.get("pending"))
        self.start_step = self.last_saved = int(extra["step"])
        self.writer.load_history(self.start_step)
        if self.is_driver:
            log.info("resumed from %s (step %d)", path, self.start_step)
            changes = config_changes(trainer.get("config") or {}, to_dict(self.cfg))
            if changes:
                log.warning("!!! RESUMING A RUN WITH A DIFFERENT CONFIG: %s was written with %s. If this is "
                            "another experiment, give it its own logging.run_name.", path, "; ".join(changes))

    def finish(self) -> None:
        if self.cfg.checkpoint.export_hf:
            from megatron_dapo.actor.hf_io import save_hf_checkpoint

            self.phases.train()
            out = save_hf_checkpoint(self.actor.module, self.actor.spec, self.ckpt_root / "hf_final", self.hf_dir)
            if self.is_driver:
                log.info("exported the final policy in Hugging Face format to %s", out)
        png = self.writer.summary_png()
        if png is not None:
            log.info("dynamics summary: %s", png)
        self.close()

    def close(self) -> None:
        """Stop what the run started and release its folder (also after an error or a signal)."""
        self.writer.close()
        if self.engine is not None:
            self.engine.shutdown()
        for server in self.servers:
            server.shutdown()
        if self.pipeline is not None:  # after the engine: a batch in production fails fast (SGLang)
            self.pipeline.close()
        if self.lock is not None:
            self.lock.release()


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """`key: saved -> now` for every setting that differs, except those a resumed run may change."""
    out = []
    for key in sorted(set(saved) | set(now)):
        dotted, a, b = f"{prefix}{key}", saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, dotted + ".")
        elif a != b and not may_change_on_resume(_DEFAULTS, dotted):
            out.append(f"{dotted}: {a!r} -> {b!r}")
    return out


def build_run(cfg: Config) -> RunState:
    """Check the user's inputs (reward, prompts, model folder); initialise processes; lock the run folder and
    choose the checkpoint to resume; build actor, engine, data and metrics; resume."""
    try:  # user inputs that load quickly fail before any process group or model exists
        scorer = Scorer(cfg.reward, cfg.rollout.max_response_len)
        policy_loss_spec(cfg.algo.policy_loss)  # a user's loss is imported (and refused) here, once
        if cfg.logging.wandb.enabled:
            import_wandb()
        prompt_format = PromptFormat.from_files(cfg.data.prompt_template, cfg.data.system_prompt,
                                                cfg.data.few_shot_path)
    except (RewardLoadError, ValueError, OSError) as e:
        raise SetupError(str(e)) from e
    parallel.initialize(cfg.parallel, seed=cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    hf_dir = cfg.model.hf_dir
    try:
        tokenizer = check_model(hf_dir)
    except SetupError as e:
        raise preflight_error(e) from None
    report = StartupReport(cfg)
    report.chat_template = use_chat_template(tokenizer, cfg.model.chat_template)
    report.system_prompt, warn = system_prompt_note(cfg.data.system_prompt, default_system_prompt(tokenizer))
    folder = Path(cfg.checkpoint.dir) / cfg.logging.run_name
    lock = run_dir.open_folder(folder, checkpoint_bytes(hf_dir, bf16=param_dtype(cfg.model) == torch.bfloat16))
    try:
        start, notes = run_dir.claim(folder, cfg.checkpoint.resume, cfg.checkpoint.overwrite)
        for note in notes if parallel.is_main() else []:
            log.warning(note)
        run = _build(cfg, tokenizer, folder, lock, scorer, prompt_format, report)
        parallel.join_driver("startup")  # the driver's engine, prompts and metrics: however long they take
        run.has_val = parallel.from_driver("has_val", "1" if run.val_prompts else "") == "1"
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if start is not None:
        run.phases.train()  # the actor's state on its device to take the checkpoint
    run.resume(start)
    if run.start_step > 0 or cfg.model.load:
        run.phases.sync(run.start_step)  # the engine started from hf_dir; give it the trained weights
    if run.is_driver:
        report.resumed_from = f"step {run.start_step}" if run.start_step else None
        log.info("start-up summary:\n  " + "\n  ".join(report.lines()))
        if warn:
            log.warning("the chat template adds a system prompt the config did not ask for: %s", report.system_prompt)
    return run


def _build(cfg: Config, tokenizer: Any, folder: Path, lock: run_dir.RunLock | None, scorer: Scorer,
           fmt: PromptFormat, report: StartupReport) -> RunState:
    hf_dir = cfg.model.hf_dir
    try:
        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor, cfg.algo, temperature=cfg.rollout.temperature,
                              max_response_len=cfg.rollout.max_response_len)
    except (UnsupportedModelError, HFCheckpointError) as e:
        raise SetupError(f"model.hf_dir={hf_dir}: {e}") from None
    report.micro_batch_tokens = (actor.cfg.micro_batch_tokens, actor.cfg.logprob_micro_batch_tokens)
    if cfg.model.load:
        try:
            load_checkpoint(actor, cfg.model.load, load_optimizer=False, load_rng=False)
        except CheckpointError as e:
            raise preflight_error(SetupError(f"model.load: {e}")) from None
    driver = parallel.is_main()
    offloads = cfg.rollout.colocate and cfg.actor.offload_when_idle
    if offloads:  # the engine sizes its memory with the actor asleep, as it will generate
        actor.sleep()
    report.actor_bytes_at_engine_start = sum(actor.device_bytes().values())
    servers = _start_sglang(cfg, hf_dir) if cfg.rollout.engine == "sglang" else None
    if servers is not None:
        engine, shared = servers.engine, False
        report.engine = f"sglang ({len(servers.owned)} server(s) started by this rank)"
    else:  # the weights are shared in a one-process job only: every rank resolves pi_old alike
        engine, shared = _embedded_engine(actor, cfg.model, report, _why_own_weights(cfg)) if driver \
            else (None, False)
    old = resolve_old_logprob_source(cfg.algo, cfg.rollout, cfg.rollout_correction(),
                                     engine_on_actor_weights=shared, dtype=param_dtype(cfg.model))
    report.old_logprobs = old.line()
    return RunState(
        cfg=cfg, actor=actor, tokenizer=tokenizer, engine=engine,
        phases=Phases(actor, engine, cfg.rollout.colocate, cfg.actor.offload_when_idle,
                      probe=WeightProbe.for_actor(actor.spec.vocab_size, param_dtype(cfg.model))
                      if cfg.rollout.weight_sync_probe else None,
                      weights=servers.weights if servers is not None else None),
        prompts=_train_iterator(cfg, tokenizer, fmt, report) if driver else None,
        val_prompts=load_val_prompts(cfg, tokenizer, fmt, report) if driver else [],
        writer=MetricsWriter(Path(cfg.logging.tensorboard_dir) / cfg.logging.run_name, enabled=driver,
                             wandb=cfg.logging.wandb, run_config=to_dict(cfg)),
        alarms=Alarms(cfg.logging, cfg.rollout.max_response_len),
        ckpt_root=folder, hf_dir=hf_dir, scorer=scorer, old_logprobs=old,
        servers=servers.owned if servers is not None else [],
        lock=lock, pipeline=RolloutPipeline() if driver and cfg.rollout.async_steps else None)


def _train_iterator(cfg: Config, tokenizer: Any, fmt: PromptFormat, report: StartupReport) -> PromptIterator:
    return PromptIterator(load_train_prompts(cfg, tokenizer, fmt, report).prompts, batch_size=1,
                          seed=cfg.train.seed, shuffle=cfg.data.shuffle)


def _start_sglang(cfg: Config, hf_dir: str):
    """Every rank: node leaders start SGLang servers; global rank 0 gets the engine over all of them."""
    from megatron_dapo.rollout.sglang.fleet import start_job_servers

    # the actor's dtype, not SGLang's "auto" (which serves a float32 checkpoint in float16)
    dtype = str(param_dtype(cfg.model)).removeprefix("torch.")
    return start_job_servers(hf_dir, cfg.rollout.sglang, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                             dtype=dtype, colocate=cfg.rollout.colocate)


def _why_own_weights(cfg: Config) -> str | None:
    """Why the embedded engine must not generate on the actor's parameters even where it could."""
    if cfg.rollout.async_steps:
        return "the engine generates while the actor trains (rollout.async_steps)"
    if cfg.rollout.colocate and cfg.actor.offload_when_idle:
        return "the actor offloads while it generates: actor.offload_when_idle=false shares the actor's weights"
    return None


def _embedded_engine(actor: Actor, model_cfg: ModelConfig, report: StartupReport,
                     why_own: str | None) -> tuple[RolloutEngine, bool]:
    """On the actor's own weights when they can be shared (shared_weights.py) and stay in place while the
    engine generates (`why_own` is None), else from hf_dir; and whether it is on the actor's weights."""
    from megatron_dapo.loop.shared_weights import can_share, model_on_actor_weights
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    hf_dir, dtype = model_cfg.hf_dir, param_dtype(model_cfg)
    own = f"its own {str(dtype).removeprefix('torch.')} copy of the weights (from {hf_dir}"
    if not can_share(actor, dtype):
        report.engine = f"embedded, {own})"
        return EmbeddedEngine(hf_dir, device=parallel.device(), dtype=dtype), False
    if why_own:
        report.engine = f"embedded, {own}; {why_own})"
        return EmbeddedEngine(hf_dir, device=parallel.device(), dtype=dtype), False
    model, shared = model_on_actor_weights(actor, hf_dir)
    total = sum(p.numel() for p in model.parameters())
    report.engine = f"embedded, on the actor's weights ({shared / 1e6:.2f}M of {total / 1e6:.2f}M parameters shared)"
    return EmbeddedEngine(model, device=parallel.device(), dtype=dtype, borrowed=actor.module.parameters()), True

"""Start-up: check the user's inputs, initialise processes, lock the run folder, build actor, engine (loop/
engines.py), data and metrics, resume."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import CheckpointError, load_checkpoint
from megatron_dapo.actor.model import UnsupportedModelError, attention_kernel, expert_kernel, param_dtype
from megatron_dapo.actor.routing import REPLAY_LINES
from megatron_dapo.algo.policy_losses import policy_loss_spec
from megatron_dapo.cli import preflight_error
from megatron_dapo.config import Config, to_dict
from megatron_dapo.data import PromptFormat, PromptIterator
from megatron_dapo.data.render import default_system_prompt, use_chat_template
from megatron_dapo.hf_files import HFCheckpointError
from megatron_dapo.loop import determinism, run_dir
from megatron_dapo.loop.engines import make_engine
from megatron_dapo.rollout.restarts import Restarts
from megatron_dapo.loop.old_policy import resolve_old_logprob_source
from megatron_dapo.loop.phases import Phases
from megatron_dapo.loop.inputs import check_inputs
from megatron_dapo.loop.preflight import SetupError, checkpoint_bytes
from megatron_dapo.loop.prompts import load_train_prompts, load_val_prompts
from megatron_dapo.loop.report import StartupReport, system_prompt_note
from megatron_dapo.loop.state import RunState
from megatron_dapo.loop.weight_probe import WeightProbe
from megatron_dapo.metrics import Alarms, MetricsWriter, PhaseTimer
from megatron_dapo.reward import RewardLoadError, Scorer
from megatron_dapo.collect import Collector, GroupScorer, PromptSource
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.collect.seeds import eos_ids
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.schedule import Schedule
from megatron_dapo.metrics.wandb_mirror import import_wandb

log = logging.getLogger(__name__)

__all__ = ["RunState", "SetupError", "build_run"]


def build_run(cfg: Config) -> RunState:
    """Check the user's inputs (reward; model folder, datasets, batch: loop/inputs.py); initialise processes;
    lock the run folder and choose the checkpoint to resume; build actor, engine, data and metrics; resume."""
    try:  # user inputs that load quickly fail before any process group or model exists
        scorer = Scorer(cfg.reward, cfg.rollout.max_response_len)
        policy_loss_spec(cfg.algo.policy_loss)  # a user's loss is imported (and refused) here, once
        if cfg.logging.wandb.enabled:
            import_wandb()
    except (RewardLoadError, ValueError, OSError) as e:
        raise SetupError(str(e)) from e
    try:  # model folder, tokenizer, datasets, batch: every rank alike, before anything loads
        tokenizer, prompt_format = check_inputs(cfg)
    except SetupError as e:
        raise preflight_error(e) from None
    if cfg.train.deterministic:  # before NCCL, cuBLAS or TE first run
        try:
            determinism.enable()
        except ValueError as e:
            raise SetupError(str(e)) from None
    parallel.initialize(cfg.parallel, seed=cfg.train.seed)
    hf_dir = cfg.model.hf_dir
    report = StartupReport(cfg)
    report.chat_template = use_chat_template(tokenizer, cfg.model.chat_template)
    report.system_prompt, warn = system_prompt_note(cfg.data.system_prompt, default_system_prompt(tokenizer))
    folder = Path(cfg.checkpoint.dir) / cfg.logging.run_name
    lock = run_dir.open_folder(folder, checkpoint_bytes(hf_dir, bf16=param_dtype(cfg.model) == torch.bfloat16))
    try:
        start, notes = run_dir.claim(folder, cfg.checkpoint.resume, cfg.checkpoint.overwrite)
        for note in notes if parallel.is_main() else []:
            log.warning(note)
        parallel.driver_phase("start-up (actor, rollout engine, prompts, metrics)")
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
    report.shared_prefix = actor.shared_prefix
    report.attention = attention_kernel(cfg.model)
    report.experts = expert_kernel(cfg.model, actor.spec)
    if report.experts:
        report.experts += f"; routing replay {cfg.actor.routing_replay} ({REPLAY_LINES[cfg.actor.routing_replay]})"
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
    restarts = Restarts(cfg.rollout.sglang.max_restarts, remote=cfg.rollout.async_steps == 0)
    engines = make_engine(cfg, actor, report, restarts)
    if engines.engine is not None and cfg.rollout.tools.enabled:
        engines.engine = _with_tools(engines.engine, cfg, tokenizer, report)
    old = resolve_old_logprob_source(cfg.algo, cfg.rollout, cfg.rollout_correction(),
                                     engine_on_actor_weights=engines.on_actor_weights, dtype=param_dtype(cfg.model),
                                     routing_replay=cfg.actor.routing_replay)
    report.old_logprobs = old.line()
    phases = Phases(actor, engines.engine, cfg.rollout.colocate, cfg.actor.offload_when_idle,
                    probe=WeightProbe.for_actor(actor.spec.vocab_size, param_dtype(cfg.model))
                    if cfg.rollout.weight_sync_probe else None, weights=engines.weights, lagged=cfg.rollout.lagged,
                    restarts=restarts.max_restarts > 0)
    parallel.on_driver_request(phases.serve)
    if cfg.rollout.async_steps == 0 or cfg.rollout.lagged:  # (k=1 batches generate while the actor trains)
        restarts.refresh = phases.refresh
    prompts = _train_iterator(cfg, tokenizer, fmt, report) if driver else None
    carry, timer = PartialCarry(), PhaseTimer()
    collector = None
    if prompts is not None and engines.engine is not None:  # the driver collects
        collector = Collector(cfg, engines.engine, PromptSource(prompts, tokenizer), GroupScorer(tokenizer, scorer),
                              carry, eos_ids(tokenizer))
    schedule = Schedule(cfg.rollout, cfg.train.steps, phases, collector, timer, actor, f"model.hf_dir={hf_dir}",
                        threads=engines.threads)
    return RunState(
        cfg=cfg, actor=actor, tokenizer=tokenizer, engine=engines.engine, phases=phases, prompts=prompts,
        val_prompts=load_val_prompts(cfg, tokenizer, fmt, report) if driver else [],
        writer=MetricsWriter(Path(cfg.logging.tensorboard_dir) / cfg.logging.run_name, enabled=driver,
                             wandb=cfg.logging.wandb, run_config=to_dict(cfg)),
        alarms=Alarms(cfg.logging, cfg.rollout.max_response_len),
        ckpt_root=folder, hf_dir=hf_dir, scorer=scorer, old_logprobs=old, schedule=schedule, carry=carry,
        timer=timer, servers=engines.servers, lock=lock, restarts=restarts)


def _with_tools(engine: RolloutEngine, cfg: Config, tokenizer: Any, report: StartupReport) -> RolloutEngine:
    """The engine made multi-turn (rollout.tools); a sandbox that cannot start stops the run here, in one line."""
    from megatron_dapo.rollout.tools import ToolLoadError, with_tools
    from megatron_dapo.sandbox import SandboxUnavailable

    tools = cfg.rollout.tools
    try:
        wrapped = with_tools(engine, tools, tokenizer, eos_ids(tokenizer))
    except (SandboxUnavailable, ToolLoadError) as e:
        engine.shutdown()
        raise SetupError(str(e)) from None
    where = "this process" if tools.name != "python" else tools.sandbox_url or "the local bubblewrap sandbox"
    report.engine += f"; multi-turn with tool {tools.name} ({where}, at most {tools.max_calls} calls a sample)"
    return wrapped


def _train_iterator(cfg: Config, tokenizer: Any, fmt: PromptFormat, report: StartupReport) -> PromptIterator:
    return PromptIterator(load_train_prompts(cfg, tokenizer, fmt, report).prompts, batch_size=1,
                          seed=cfg.train.seed, shuffle=cfg.data.shuffle)



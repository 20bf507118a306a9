"""DAPO training (Algorithm 1 of Yu et al. 2025), top to bottom.

    python -m megatron_dapo.train --config examples/configs/tiny_cpu.yaml [section.key=value ...]
    torchrun --nproc_per_node 2 -m megatron_dapo.train --config ... parallel.tensor_parallel=2

Global rank 0 drives the rollout engine; every rank trains its shard of the Megatron actor.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from megatron_dapo import parallel
from megatron_dapo.actor.actor import NonFiniteWeightsError
from megatron_dapo.actor.checkpoint import CheckpointError, latest_checkpoint, step_dir, step_of
from megatron_dapo.actor.checkpoint_files import verify
from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.policy_losses import policy_loss_spec
from megatron_dapo.algo.train_batch import build_train_batch, group_rewards, overlong_weights, void_turn_weights
from megatron_dapo.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError, print_error, quiet_third_party
from megatron_dapo.config import Config, ConfigError, build_parser, load_config, to_yaml, validate
from megatron_dapo.heartbeat import DriverHungError
from megatron_dapo.loop import distribute, monitors
from megatron_dapo.loop.build import build_run
from megatron_dapo.loop.evaluation import validate as run_validation
from megatron_dapo.loop.inputs import check_inputs
from megatron_dapo.loop.old_policy import apply_rollout_correction, old_logprobs
from megatron_dapo.loop.preempt import Preempted, StartInterrupted, StopSignals
from megatron_dapo.loop.report import pace_line
from megatron_dapo.loop.state import RunState
from megatron_dapo.loop.weight_probe import WeightSyncError
from megatron_dapo.metrics import progress
from megatron_dapo.rollout.restarts import EngineLostError
from megatron_dapo.types import Group, TrainBatch

log = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, float]:
    """Run the configured steps (resuming if asked); returns the last step's scalars. On SIGTERM / SIGUSR1
    the step in flight is finished and saved, then Preempted is raised."""
    if (done := already_trained(cfg)) is not None:
        print_error("train", done, kind="nothing to train", same_on_all_ranks=True)
        return {}
    stop = StopSignals().install()
    try:
        run = start_run(cfg, stop)
        try:
            out = _steps(run, stop)
            run.finish()
        except BaseException:
            run.close()
            raise
    finally:
        stop.restore()
    return out


def already_trained(cfg: Config) -> str | None:
    """One line saying so when checkpoint.resume=auto would resume at or past train.steps with the final
    policy exported: re-running a finished run, or asking for fewer steps than it has. (Without hf_final, a
    run stopped after its last save, it starts: to export it.)"""
    root = Path(cfg.checkpoint.dir) / cfg.logging.run_name
    last = latest_checkpoint(root) if cfg.checkpoint.resume == "auto" else None
    exported = not cfg.checkpoint.export_hf or (root / "hf_final" / "config.json").is_file()
    if last is None or step_of(last) < cfg.train.steps or not exported or verify(last) is not None:
        return None  # a corrupt newest checkpoint is set aside by the resume, which then trains from an older one
    return (f"{root} already holds step {step_of(last)} and train.steps={cfg.train.steps}; to start fresh, "
            "give the run another logging.run_name (or replace it: checkpoint.resume=none "
            "checkpoint.overwrite=true); to continue it, raise train.steps")


def start_run(cfg: Config, stop: StopSignals) -> RunState:
    """build_run; a stop signal meanwhile interrupts it at once (the servers are stopped, nothing is saved) and
    raises Preempted. Any failure after a stop signal is its doing (another rank stopped mid-collective)."""
    run = None
    try:
        run = build_run(cfg)
        stop.started()
        return run
    except (StartInterrupted, Exception) as e:
        if run is not None:
            run.close()
        if not stop.signum:
            raise
        last = latest_checkpoint(Path(cfg.checkpoint.dir) / cfg.logging.run_name)
        raise Preempted(stop.signum, None, None if last is None else str(last)) from (
            None if isinstance(e, StartInterrupted) else e)


def _steps(run: RunState, stop: StopSignals) -> dict[str, float]:
    cfg, out = run.cfg, {}
    if signum := stop.requested():  # while starting: nothing new to save
        last = run.last_saved
        raise Preempted(signum, run.start_step, None if last is None else str(step_dir(run.ckpt_root, last)))
    evaluated, stop.step = {}, run.start_step + 1  # a stop signal from now on lets that step finish
    if run.start_step == 0 and run.wants_eval(0):
        evaluated = validate_policy(run, 0)
        write(run, 0, evaluated)
    bar = progress(range(run.start_step + 1, cfg.train.steps + 1), enabled=run.is_driver)
    for step in bar:
        out = dapo_step(run, step)
        last = run.budget_spent()
        if run.wants_eval(step) or (last and run.has_val):
            out.update(validate_policy(run, step))
        write(run, step, out, bar)
        if step == run.start_step + 1 and run.is_driver and not last:
            evals = sum(run.wants_eval(s) for s in range(step + 1, cfg.train.steps + 1))
            log.info(pace_line({**evaluated, **out}, cfg.train.steps - step, evals))
        signum = stop.requested()
        stop.step = step + 1 if step < cfg.train.steps and not last else None
        if run.wants_checkpoint(step) or last or signum:
            run.save(step)
        if signum:
            raise Preempted(signum, step, str(step_dir(run.ckpt_root, step)))
        if last:
            log.info("rollout budget of %d responses spent after step %d", cfg.train.rollout_budget, step)
            break
    if hasattr(bar, "close"):
        bar.close()
    return out


def dapo_step(run: RunState, step: int) -> dict[str, float]:
    """One DAPO step: rollout -> rewards -> dynamic sampling -> advantages -> pi_old -> updates -> sync.
    When the weights move (rollout.async_steps) is the schedule's: run.schedule (schedule/schedule.py)."""
    cfg, timer, schedule, t_step = run.cfg, run.timer, run.schedule, time.perf_counter()
    run.phases.generate()
    parallel.driver_phase(f"rollout of step {step}")
    with timer("rollout"):  # generation, reward scoring and dynamic sampling, round by round or group by group
        rollout = schedule.rollout(step) if run.is_driver else None
        parallel.join_driver("rollout")  # the other ranks wait host-side, however long the rollout takes
    out, batch = {}, None
    if rollout is not None:  # the driver: monitors over everything generated, then the batch to train on
        run.write_samples(step, "train", rollout.generated)
        groups, staleness = schedule.fresh(rollout.groups, step)  # off-policy: too stale a group is dropped
        out.update(staleness)
        groups = distribute.trainable(groups, run.num_mini_batches)  # whole mini-batches on every DP rank
        out.update({**rollout.scalars(), **run.restarts.scalars(), "rollout/groups_trained": float(len(groups))})
        batch = train_batch(run, groups) if groups else None
        if not groups:  # the sampled responses of this step are written too (RunState.wants_samples)
            log.warning("step %d: %s", step, monitors.why_no_signal(rollout.generated, cfg.reward.answer_fallback))
    generated = rollout.samples_generated if rollout is not None else 0  # the rollout budget: every rank checks it
    run.samples_generated += int(parallel.from_driver(f"samples/{step}", str(generated)))
    batch, moved = distribute.scatter(batch)
    out.update({"rollout/samples_total": float(run.samples_generated), **moved.scalars()})
    if batch is None:
        log.warning("step %d: no informative group to train on; skipping the update", step)
        schedule.skip(step)
        return {**out, **step_timings(run, t_step, 0, None)}
    run.phases.train()
    with timer("old_logprob"):
        batch.old_logprobs, entropy = old_logprobs(run.actor, batch, run.old_logprobs)
    out.update(apply_rollout_correction(batch, cfg.algo, cfg.rollout_correction()))
    with timer("update"):
        try:
            update = run.actor.train_step(batch, num_mini_batches=run.num_mini_batches,
                                          epochs=cfg.algo.epochs_per_rollout)
        except NonFiniteWeightsError as e:
            raise NonFiniteWeightsError(f"step {step}: {e}") from None
    schedule.boundary()
    with timer("weight_sync"):
        sync = schedule.publish(step)
    out.update(monitors.update_scalars(update, monitors.token_means(batch, entropy)))
    out.update(run.phases.ledger)
    return {**out, **step_timings(run, t_step, int(batch.lengths.sum()), sync.scalars())}


def train_batch(run: RunState, groups: list[Group]) -> TrainBatch:
    """The kept groups as token rows: each sample's advantage within its group (divided by the group's std
    unless the policy loss says not: Dr. GRPO), truncated samples out of the loss with overlong filtering, void
    turns' samples with the void-turn filter."""
    scale = policy_loss_spec(run.cfg.algo.policy_loss).scale_advantages_by_std
    advantages = group_advantages(group_rewards(groups), scale_by_std=scale)
    weights = overlong_weights(groups) if run.cfg.algo.overlong_filtering else None
    if run.cfg.algo.void_turn_filter:
        void = void_turn_weights(groups)
        weights = [a * b for a, b in zip(weights or [1.0] * len(void), void)]
    return build_train_batch(groups, advantages, loss_weights=weights, pad_id=run.tokenizer.pad_token_id or 0)


def step_timings(run: RunState, t_step: float, tokens: int, sync: dict[str, float] | None) -> dict[str, float]:
    timings = monitors.step_timings(run.timer.take(), time.perf_counter() - t_step, tokens, sync)
    return {**timings, **run.schedule.scalars()}


def validate_policy(run: RunState, step: int) -> dict[str, float]:
    """avg@k, pass@k, maj@k on the validation prompts (driver only; other ranks return nothing), on the
    weights after `step` (val/policy_version says so with off-policy pipelining)."""
    run.schedule.settle(step)
    run.phases.generate()
    parallel.driver_phase(f"evaluation after step {step}")
    with run.schedule.checked(after_step=step):
        result = run_validation(run.engine, run.tokenizer, run.val_prompts, run.cfg, run.eos_ids, run.scorer) \
            if run.is_driver else None
    parallel.join_driver("eval")
    if result is None:
        return {}
    run.write_samples(step, "val", result.groups)
    return {**result.val_scalars(), "timing/eval_s": result.seconds, **run.schedule.version_scalars()}


def write(run: RunState, step: int, values: dict[str, float], bar=None) -> None:
    """Alarms on top of the step's scalars, to TensorBoard; a few of them on the progress bar."""
    values = {**values, **run.alarms.check(values)}
    run.writer.write(step, values)
    if hasattr(bar, "set_postfix"):
        bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in values.items()
                         if k in ("train/acc_mean", "val/acc_avg_at_k", "actor/entropy")})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Train a policy with DAPO.")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and check the config, the model folder and the data, then exit")
    args = parser.parse_intermixed_args(argv)  # overrides before or after flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.world_size or parallel.launch_env().world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:  # what the run itself would refuse before anything loads
        try:
            check_inputs(cfg)
        except UserError as e:
            print_error("train", e)
            return EXIT_USER_ERROR
    if args.print or args.dry_run:
        print(to_yaml(cfg), end="")
    if args.dry_run:
        return 0
    return run_training(cfg)


def run_training(cfg: Config) -> int:
    """train(cfg), every way it can end turned into one line on stderr and an exit code: 0 done;
    2 bad input (model, data, run folder); 1 the run failed (non-finite weights, a bad checkpoint, a hung driver);
    128 + signal after a preemption checkpoint; 130 on Ctrl-C (the last complete checkpoint intact)."""
    try:
        train(cfg)
        return 0
    except UserError as e:
        print_error("train", e)
        return EXIT_USER_ERROR
    except (NonFiniteWeightsError, CheckpointError, WeightSyncError, DriverHungError, EngineLostError) as e:
        print_error("train", e)
        return 1
    except Preempted as e:
        print_error("train", e, kind="preempted", same_on_all_ranks=True)
        return e.exit_code
    except KeyboardInterrupt:
        last = latest_checkpoint(Path(cfg.checkpoint.dir) / cfg.logging.run_name)
        print_error("train", interrupted_line(last), kind="interrupted (Ctrl-C)", same_on_all_ranks=True)
        return EXIT_INTERRUPTED
    finally:
        parallel.destroy()


def interrupted_line(last: Path | None) -> str:
    """What Ctrl-C leaves: Ctrl-C does not save the step in flight (SIGTERM does), and how to go on."""
    if last is None:
        return ("no checkpoint yet (Ctrl-C does not save; SIGTERM finishes the step and saves): rerun the same "
                "command to start again")
    return (f"last complete checkpoint: {last} (Ctrl-C does not save the step in flight; SIGTERM does): rerun "
            "the same command to resume from it")


if __name__ == "__main__":
    sys.exit(main())

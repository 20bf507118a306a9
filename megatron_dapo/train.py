"""DAPO training (Algorithm 1 of Yu et al. 2025), top to bottom.

    python -m megatron_dapo.train --config examples/configs/tiny_cpu.yaml [section.key=value ...]
    torchrun --nproc_per_node 2 -m megatron_dapo.train --config ... parallel.tensor_parallel=2

Global rank 0 drives the rollout engine; every rank trains its shard of the Megatron actor.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_dapo import parallel
from megatron_dapo.actor.actor import NonFiniteWeightsError
from megatron_dapo.actor.checkpoint import CheckpointError, latest_checkpoint, step_dir
from megatron_dapo.algo.policy_losses import policy_loss_spec
from megatron_dapo.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError, print_error, quiet_third_party
from megatron_dapo.config import Config, ConfigError, build_parser, load_config, to_yaml, validate
from megatron_dapo.loop import distribute, scalars
from megatron_dapo.loop.collect import StepRollout, collect_step, evaluate, step_sampling
from megatron_dapo.loop.old_policy import apply_rollout_correction, old_logprobs
from megatron_dapo.loop.pipeline import drop_stale, staleness_scalars
from megatron_dapo.loop.preempt import Preempted, StartInterrupted, StopSignals
from megatron_dapo.loop.state import RunState, build_run
from megatron_dapo.loop.weight_probe import WeightSyncError
from megatron_dapo.loop.stream import collect_stream, group_sampling, rollout_cost_scalars
from megatron_dapo.metrics import progress
from megatron_dapo.rollout.base import NonFiniteLogitsError

log = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, float]:
    """Run the configured steps (resuming if asked); returns the last step's scalars. On SIGTERM / SIGUSR1
    the step in flight is finished and saved, then Preempted is raised."""
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


def start_run(cfg: Config, stop: StopSignals) -> RunState:
    """build_run; a stop signal meanwhile interrupts it at once (the servers are stopped, nothing is saved) and
    raises Preempted. Any failure after a stop signal is its doing (another rank stopped mid-collective)."""
    run = None
    try:
        run = build_run(cfg)
        if run.pipeline is not None:
            run.pipeline.produce = lambda step: collect(run, step)
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
    if run.start_step == 0 and run.wants_eval(0):
        write(run, 0, validate_policy(run, 0))
    bar = progress(range(run.start_step + 1, cfg.train.steps + 1), enabled=run.is_driver)
    for step in bar:
        out = dapo_step(run, step)
        last = run.budget_spent()
        if run.wants_eval(step) or (last and run.has_val):
            out.update(validate_policy(run, step))
        write(run, step, out, bar)
        signum = stop.requested()
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
    """One DAPO step: rollout -> rewards -> dynamic sampling -> advantages -> pi_old -> updates -> sync."""
    cfg, timer, t_step = run.cfg, run.timer, time.perf_counter()
    scale_by_std = policy_loss_spec(cfg.algo.policy_loss).scale_advantages_by_std  # False for Dr. GRPO
    pipeline, out = run.pipeline, {}
    run.phases.generate()
    with timer("rollout"):  # (generation and reward scoring happen round by round, or group by group)
        with rollout_logits_checked(run, after_step=step - 1 if pipeline is None else run.phases.step):
            rollout = (collect(run, step) if pipeline is None else pipeline.take(step)) if run.is_driver else None
        if pipeline is not None and run.is_driver:  # off-policy: the next batch generates while this one trains
            if step < cfg.train.steps:
                pipeline.start(step + 1)
            out.update(staleness_scalars(rollout, step - 1, drop_stale(rollout, step - 1, cfg.rollout.async_steps)))
        parallel.join_driver("rollout")  # the other ranks wait host-side, however long the rollout takes
        rows = distribute.step_rows(rollout, num_mini_batches=run.num_mini_batches,
                                    overlong_filtering=cfg.algo.overlong_filtering,
                                    pad_id=run.tokenizer.pad_token_id or 0, scale_by_std=scale_by_std)
    if pipeline is None:
        timer.move("rollout", "reward", rollout.reward_seconds if rollout is not None else 0.0)
    elif rollout is not None:  # scored in the producer, overlapping the previous step
        out["timing/reward_s"] = rollout.reward_seconds
    run.samples_generated += rows.samples_generated
    out.update({"rollout/samples_total": float(run.samples_generated),
                "rollout/groups_trained": float(rows.groups_trained)})
    if rollout is not None:  # the driver has every sample: the all-sample monitors are computed there
        run.write_samples(step, "train", rollout.generated)
        out.update(scalars.rollout_scalars(rollout, samples_total=run.samples_generated,
                                           groups_trained=rows.groups_trained))
        out.update(rollout.monitors())
        out.update(rollout_cost_scalars(rollout, cfg.algo))
    out.update({"perf/rollout_bytes_total": float(rows.bytes_total),
                "perf/rollout_bytes_max_recv": float(distribute.max_received(rows))})
    batch = rows.batch
    if batch is None:
        log.warning("step %d: no informative group to train on; skipping the update", step)
        batch_boundary(run)
        return {**out, **scalars.step_timings(timer.take(), time.perf_counter() - t_step, 0, None),
                **(pipeline.step_scalars() if pipeline is not None else {})}
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
    batch_boundary(run)
    with timer("weight_sync"):
        sync = run.phases.sync(step)
    out.update(scalars.update_scalars(update, parallel.dp_sum(scalars.token_sums(batch, entropy))))
    out.update(run.phases.ledger)
    tokens = int(batch.lengths.sum())
    return {**out, **scalars.step_timings(timer.take(), time.perf_counter() - t_step, tokens, sync.scalars()),
            **(pipeline.step_scalars() if pipeline is not None else {})}


def batch_boundary(run: RunState) -> None:
    """Off-policy pipelining: wait for the next batch (generated from the weights the engine still holds)
    before those weights change. Nothing to do in the synchronous loop."""
    if run.pipeline is not None:
        with rollout_logits_checked(run, after_step=run.phases.step):
            with run.timer("rollout_wait"):
                run.pipeline.wait()


def collect(run: RunState, step: int) -> StepRollout:
    """The step's groups (driver only): streamed (`rollout.streaming`) or in synchronous rounds."""
    cfg = run.cfg
    common = dict(target_groups=cfg.train.prompt_batch_size, algo=cfg.algo, scorer=run.scorer,
                  version=run.phases.step)  # the engine's weights are those after step `version`
    if cfg.rollout.streaming:
        rollout = collect_stream(run.engine, run.tokenizer, run.next_prompts, **common,
                                 sampling=lambda g: group_sampling(cfg, step, g, run.eos_ids),
                                 max_inflight_groups=cfg.rollout.max_inflight_groups,
                                 partial=cfg.rollout.partial_rollout, carry=run.carry,
                                 max_carry_steps=cfg.rollout.max_carry_steps)
        run.carry = rollout.carry
        return rollout
    return collect_step(run.engine, run.tokenizer, run.next_prompts, **common,
                        sampling=lambda r: step_sampling(cfg, step, r, run.eos_ids))


def validate_policy(run: RunState, step: int) -> dict[str, float]:
    """avg@k, pass@k, maj@k on the validation prompts (driver only; other ranks return nothing)."""
    run.phases.generate()
    with rollout_logits_checked(run, after_step=step):
        result = evaluate(run.engine, run.tokenizer, run.val_prompts, run.cfg, run.eos_ids, run.scorer) \
            if run.is_driver else None
    parallel.join_driver("eval")
    if result is None:
        return {}
    run.write_samples(step, "val", result.groups)
    return {**result.val_scalars(), "timing/eval_s": result.seconds}


@contextmanager
def rollout_logits_checked(run: RunState, after_step: int) -> Iterator[None]:
    """An engine's NonFiniteLogitsError, however wrapped (stream, engine group), becomes one line naming the
    weights the rollout ran on: those of step `after_step`'s update, or the ones the run started from."""
    try:
        yield
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, NonFiniteLogitsError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        if after_step > run.start_step:
            where = f"after step {after_step}: the last update diverged ({run.actor.last_update or 'no update'})"
        else:
            start = f"checkpoint step {after_step}" if after_step else f"model.hf_dir={run.hf_dir}"
            where = f"of step {after_step + 1}: the weights the run started from ({start}) are unusable"
        raise NonFiniteWeightsError(f"non-finite logits in the rollout {where}: {cause}; stopped without saving "
                                    f"these weights (lower actor.optimizer.lr?)") from None


def write(run: RunState, step: int, values: dict[str, float], bar=None) -> None:
    """Alarms on top of the step's scalars, to TensorBoard; a few of them on the progress bar."""
    values = {**values, **run.alarms.check(values)}
    run.writer.write(step, values)
    if hasattr(bar, "set_postfix"):
        bar.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in values.items()
                         if k in ("train/acc_mean", "val/acc_avg_at_k", "actor/entropy")})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Train a policy with DAPO.")
    parser.add_argument("--dry-run", action="store_true", help="resolve and check the config, then exit")
    args = parser.parse_intermixed_args(argv)  # overrides before or after flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.world_size or parallel.launch_env().world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print or args.dry_run:
        print(to_yaml(cfg), end="")
    if args.dry_run:
        return 0
    return run_training(cfg)


def run_training(cfg: Config) -> int:
    """train(cfg), every way it can end turned into one line on stderr and an exit code: 0 done;
    2 bad input (model, data, run folder); 1 the run failed (non-finite weights, a bad checkpoint);
    128 + signal after a preemption checkpoint; 130 on Ctrl-C (the last complete checkpoint intact)."""
    try:
        train(cfg)
        return 0
    except UserError as e:
        print_error("train", e)
        return EXIT_USER_ERROR
    except (NonFiniteWeightsError, CheckpointError, WeightSyncError) as e:
        print_error("train", e)
        return 1
    except Preempted as e:
        print_error("train", e, kind="preempted", same_on_all_ranks=True)
        return e.exit_code
    except KeyboardInterrupt:
        last = latest_checkpoint(Path(cfg.checkpoint.dir) / cfg.logging.run_name)
        print_error("train", f"last complete checkpoint: {last or 'none'}", kind="interrupted (Ctrl-C)",
                    same_on_all_ranks=True)
        return EXIT_INTERRUPTED
    finally:
        parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

"""DAPO training (Algorithm 1 of Yu et al. 2025), top to bottom.

    python -m megatron_dapo.train --config examples/configs/tiny_cpu.yaml [section.key=value ...]
    torchrun --nproc_per_node 2 -m megatron_dapo.train --config ... parallel.tensor_parallel=2

Global rank 0 drives the rollout engine; every rank trains its shard of the Megatron actor.
"""

from __future__ import annotations

import logging
import sys
import time

from megatron_dapo import parallel
from megatron_dapo.cli import quiet_third_party
from megatron_dapo.config import Config, ConfigError, build_parser, load_config, to_yaml, validate
from megatron_dapo.rollout.collect import StepRollout, collect_step
from megatron_dapo.run_state import RunState, SetupError, build_run, step_sampling

log = logging.getLogger("megatron_dapo.train")


def train(cfg: Config) -> dict[str, float]:
    """Run the configured steps (resuming if asked); returns the last step's scalars."""
    run = build_run(cfg)
    scalars: dict[str, float] = {}
    if run.start_step == 0 and run.wants_eval(0):
        run.write(0, run.evaluate())
    for step in run.progress(range(run.start_step + 1, cfg.train.steps + 1)):
        scalars = dapo_step(run, step)
        last = run.budget_spent()
        if run.wants_eval(step) or (last and run.val_prompts):
            scalars.update(run.evaluate())
        run.write(step, scalars)
        if run.wants_checkpoint(step) or last:
            run.save(step)
        if last:
            log.info("rollout budget of %d responses spent after step %d", cfg.train.rollout_budget, step)
            break
    run.finish()
    return scalars


def dapo_step(run: RunState, step: int) -> dict[str, float]:
    """One DAPO step: rollout -> rewards -> dynamic sampling -> advantages -> pi_old -> updates -> sync."""
    cfg, t_step = run.cfg, time.perf_counter()
    with run.timer("rollout"):  # (generation and reward scoring happen round by round)
        rollout: StepRollout | None = None
        if run.is_driver:
            rollout = collect_step(run.engine, run.tokenizer, run.next_prompts, target_groups=run.target_groups,
                                   algo=cfg.algo, reward=cfg.reward, max_response_len=cfg.rollout.max_response_len,
                                   sampling=lambda r: step_sampling(cfg, step, r, run.eos_ids))
        rollout = run.broadcast(rollout)
    scalars = run.rollout_scalars(rollout)
    groups = run.trainable(rollout.groups)
    if not groups:
        log.warning("step %d: no informative group to train on; skipping the update", step)
        return {**scalars, **run.timings(t_step)}
    batch = run.local_batch(groups)  # advantages + this DP rank's rows
    run.engine_sleep()
    with run.timer("old_logprob"):
        batch.old_logprobs, entropy = run.actor.compute_logprobs(batch)
    with run.timer("update"):
        update = run.actor.train_step(batch, num_mini_batches=run.num_mini_batches, epochs=cfg.algo.epochs_per_rollout)
    with run.timer("weight_sync"):
        run.sync_weights()
    scalars.update(run.update_scalars(update, batch, entropy, groups))
    return {**scalars, **run.timings(t_step, tokens=int(batch.lengths.sum()))}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Train a policy with DAPO.")
    parser.add_argument("--dry-run", action="store_true", help="resolve and check the config, then exit")
    args = parser.parse_args(argv)
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
    try:
        train(cfg)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

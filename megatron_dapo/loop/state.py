"""What a DAPO run holds between steps, and its life cycle after start-up (loop/build.py): the schedule,
sample records, save, resume, finish. Rank 0 is the rollout driver; every rank trains its actor shard."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_dapo.config import Config, config_changes, to_dict
from megatron_dapo.data import PromptIterator
from megatron_dapo.loop import run_dir
from megatron_dapo.loop.old_policy import OldLogprobSource
from megatron_dapo.loop.phases import Phases
from megatron_dapo.metrics import Alarms, MetricsWriter, PhaseTimer
from megatron_dapo.reward import Scorer
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.restarts import Restarts
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.collect.seeds import eos_ids
from megatron_dapo.schedule import Schedule
from megatron_dapo.stop_signals import helpers_shielded
from megatron_dapo.types import Group, Prompt

log = logging.getLogger(__name__)


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
    schedule: Schedule
    """When the weights move, and the driver's collection of each step's groups (schedule/schedule.py)."""
    start_step: int = 0
    samples_generated: int = 0
    carry: PartialCarry = field(default_factory=PartialCarry)
    """Partial rollout: the groups the last step aborted, continued by the next (collect/streaming.py)."""
    servers: list[Any] = field(default_factory=list)
    """SGLang: servers this rank started for rank 0 to drive (a node leader's); finish() stops them."""
    lock: run_dir.RunLock | None = None
    """The run folder's lock (rank 0); released by close()."""
    last_saved: int | None = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    restarts: Restarts = field(default_factory=lambda: Restarts(0))
    """The run's budget of rollout-engine restarts and their counts (rollout/engine_restarts, resubmitted_groups)."""
    has_val: bool = False
    """The driver loaded validation prompts; every rank knows it (validation moves the devices collectively)."""

    @property
    def is_driver(self) -> bool:
        return parallel.is_main()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.tokenizer)

    @property
    def num_mini_batches(self) -> int:
        return self.cfg.train.prompt_batch_size // self.cfg.train.mini_batch_size

    # --- schedule -----------------------------------------------------------------------------------

    def budget_spent(self) -> bool:
        budget = self.cfg.train.rollout_budget
        return budget > 0 and self.samples_generated >= budget

    def wants_eval(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return self.has_val and every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def wants_samples(self, step: int) -> bool:
        """Every logging.samples_every steps, and step 1 whatever it says: what the model says, seen at once."""
        every = self.cfg.logging.samples_every
        return step == 1 or (every > 0 and step % every == 0)

    def write_samples(self, step: int, split: str, groups: list[Group]) -> None:
        """Driver: a few responses of `groups` to samples/step_<k>.jsonl and TensorBoard text (val: at
        every evaluation; train: step 1 and every logging.samples_every steps)."""
        if not self.is_driver or (split == "train" and not self.wants_samples(step)):
            return
        records = sample_records(groups, self.tokenizer, self.cfg.logging.samples_per_step, step, split)
        self.writer.write_samples(step, split, records)

    def wants_checkpoint(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return (every > 0 and step % every == 0) or step == self.cfg.train.steps

    # --- checkpoints and the end ----------------------------------------------------------------------

    def parts(self) -> dict[str, Stateful]:
        """What a checkpoint holds of the run besides the actor and the schedule's pending batches, each part under
        its key (registered here once). The schedule is apart: its state_dict finishes the batches in production,
        which move these (and the carry), so save() asks it first; its load takes the checkpoint's step."""
        parts: dict[str, Stateful] = {}
        if self.prompts is not None:
            parts["data"] = self.prompts
        parts |= {"alarms": self.alarms, "samples_generated": _Counter(self, "samples_generated"),
                  "carry": self.carry, "restarts": self.restarts}
        return parts

    def save(self, step: int) -> None:
        state = {"pending": self.schedule.state_dict()}  # first: its batches move the prompts, count and carry
        state |= {key: part.state_dict() for key, part in self.parts().items()}  # read after that
        state["config"] = to_dict(self.cfg)
        self.phases.train()  # the actor's state on its device (it may sleep through the rollout)
        with helpers_shielded():  # megatron-core's writer processes (and, once, a resource tracker) start here
            save_checkpoint(self.actor, self.ckpt_root, step, trainer_state=state,
                            keep_last=self.cfg.checkpoint.keep_last, hf_dir=self.hf_dir)
        self.last_saved = step

    def resume(self, path: Path | None) -> None:
        """Continue from the checkpoint run_dir.claim chose (None: start from scratch)."""
        if path is None:
            return
        extra = load_checkpoint(self.actor, path, verify=False)  # claim() verified it
        trainer = extra.get("trainer", {})
        if not self.cfg.rollout.partial_rollout:
            trainer["carry"] = []  # groups a run with partial rollout left behind are dropped: they start afresh
        self.start_step = self.last_saved = int(extra["step"])
        for key, part in self.parts().items():
            if trainer.get(key) is not None:  # a part an older checkpoint lacks starts afresh
                part.load_state_dict(trainer[key])
        self.schedule.load_state_dict(trainer.get("pending"), self.start_step)
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
        self.schedule.close()  # after the engine: a batch in production fails fast (SGLang)
        if self.lock is not None:
            self.lock.release()


def sample_records(groups: Sequence[Group], tokenizer: Any, limit: int, step: int,
                   split: str) -> list[dict[str, Any]]:
    """Up to `limit` samples for a human to read, spread over groups (sample i of every group, then i+1)."""
    width = max((len(g.samples) for g in groups), default=0)
    picked = [(g, g.samples[i]) for i in range(width) for g in groups if i < len(g.samples)][:max(limit, 0)]
    return [{"step": step, "split": split, "uid": g.prompt.uid,
             "prompt": tokenizer.decode(list(s.prompt_ids), skip_special_tokens=False),
             "response": s.response_text, "ground_truth": g.prompt.ground_truth, "pred": s.pred,
             "reward": s.reward, "acc": bool(s.acc), "length": s.response_len, "finish_reason": s.finish_reason}
            for g, s in picked]


class Stateful(Protocol):
    """A part of the run a checkpoint holds (torchtitan's Stateful): plain JSON out, the same JSON back in."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class _Counter:
    """A RunState int attribute as a part."""

    run: RunState
    name: str

    def state_dict(self) -> int:
        return int(getattr(self.run, self.name))

    def load_state_dict(self, state: int) -> None:
        setattr(self.run, self.name, int(state))

"""Weights & Biases beside TensorBoard (`logging.wandb`): the same scalars, the sampled responses as tables,
the run's config. TensorBoard stays the source of truth: a W&B call that fails is logged once, and the
mirror stops; the run goes on.

A run keeps its W&B id in <tensorboard_dir>/<run_name>/wandb_run_id, so a resumed run continues the same
W&B run (W&B drops the replayed steps it already holds: steps must increase).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron_dapo.cli import UserError
from megatron_dapo.config import WandbConfig

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "megatron-dapo[wandb]" (or pip install wandb)'
ID_FILE = "wandb_run_id"


class WandbSetupError(UserError, ValueError):
    """logging.wandb.enabled, but wandb cannot be imported or its run cannot start (one line, exit 2)."""


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise WandbSetupError(f"logging.wandb.enabled=true needs the wandb package: {INSTALL_HINT}") from e
    return wandb


class WandbMirror:
    """One W&B run for the TensorBoard folder `logdir` (the driver rank only)."""

    def __init__(self, cfg: WandbConfig, logdir: Path, run_name: str, config: dict[str, Any]) -> None:
        wandb = import_wandb()
        self._table, self._teardown = wandb.Table, wandb.teardown
        id_file = logdir / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: W&B draws one
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=run_name, id=run_id,
                                  resume="allow", mode=cfg.mode, dir=str(logdir), config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # wandb raises its own types (no login, bad entity, no network in online mode)
            raise WandbSetupError(f"logging.wandb: the W&B run did not start ({type(e).__name__}: {e}); "
                                  "logging.wandb.mode=offline needs no network") from e
        id_file.write_text(self.run.id)

    def log(self, step: int, values: dict[str, Any]) -> None:
        self._call("log", values, step=step)

    def log_samples(self, step: int, split: str, records: list[dict[str, Any]]) -> None:
        columns = list(records[0])
        table = self._table(columns=columns, data=[[r.get(c) for c in columns] for r in records])
        self.log(step, {f"samples/{split}": table})

    def finish(self) -> None:
        """End the run and stop W&B's service process."""
        self._call("finish")
        self.run = None
        self._teardown()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        try:
            getattr(self.run, method)(*args, **kwargs)
        except Exception as e:
            log.warning("W&B mirror stopped after an error (%s: %s); TensorBoard keeps every value",
                        type(e).__name__, e)
            self.run = None

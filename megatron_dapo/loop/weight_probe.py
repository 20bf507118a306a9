"""The weight-sync probe: after every sync the rollout engine and the actor score one fixed sequence
(teacher-forced, temperature 1); their logprobs must agree within the rounding of the model's dtype, or the
run stops with one line. A safety net for any way the engine's weights can go wrong that the review of
the transports missed: a lost memory region, a tensor never sent, a wrong layout, a stale server.

Cheap: one forward of PROBE_LEN tokens on each side. The actor's side runs in the sync phase (the actor on
its devices), the engine's once it has its KV cache back (generate phase)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.types import TrainBatch

log = logging.getLogger(__name__)

PROBE_LEN, PROMPT_LEN = 16, 8
"""The probe: PROMPT_LEN tokens of context, then the PROBE_LEN - PROMPT_LEN tokens whose logprobs are compared."""
TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 0.5}
"""Mean |logprob difference| over the probe's tokens allowed per model dtype. Engine and actor use different
kernels: in fp32 they agree within ~1e-5 (SGLang against transformers), in bf16 within ~0.05 on average
(0.35 at the worst token); a lost or garbled tensor moves logprobs by whole nats, or makes them NaN."""


class WeightSyncError(RuntimeError):
    """The engine's weights are not the actor's after a sync (a rank's part of the transfer failed, or the probe
    found them different): the run stops before generating from them."""


def probe_tokens(vocab_size: int) -> list[int]:
    """A fixed pseudo-random sequence over the vocabulary (the same in every run)."""
    g = torch.Generator().manual_seed(20250317)
    return torch.randint(0, vocab_size, (PROBE_LEN,), generator=g).tolist()


@dataclass
class WeightProbe:
    tokens: list[int]
    tolerance: float
    dtype_name: str

    @classmethod
    def for_actor(cls, vocab_size: int, dtype: torch.dtype) -> WeightProbe:
        return cls(probe_tokens(vocab_size), TOLERANCE[dtype], str(dtype).removeprefix("torch."))

    def actor_logprobs(self, actor) -> torch.Tensor:
        """Collective over the actor's ranks (the actor awake): log pi(token t | tokens < t) at T=1 for the
        probe's scored tokens."""
        ids = torch.tensor([self.tokens])
        batch = TrainBatch(input_ids=ids, loss_mask=torch.zeros(ids.shape), advantages=torch.zeros(1),
                           lengths=torch.tensor([len(self.tokens)]))
        return actor.compute_logprobs(batch, temperature=1.0)[0][0, PROMPT_LEN:].double()

    def engine_absdiff(self, engine: RolloutEngine, expected: torch.Tensor) -> float:
        """The driver: the worst replica's mean |engine - actor| logprob difference (inf if not finite)."""
        worst = 0.0
        for scored in engine.score(self.tokens, PROMPT_LEN):
            diff = (torch.tensor(scored, dtype=torch.float64) - expected).abs().mean().item()
            worst = max(worst, diff if math.isfinite(diff) else math.inf)
        return worst

    def check(self, engine: RolloutEngine | None, expected: torch.Tensor, step: int) -> float:
        """Collective: the difference on the driver, the same verdict on every rank; WeightSyncError above
        the tolerance (or when the engine cannot score the probe)."""
        cause = ""
        value = torch.zeros(1, dtype=torch.float64)
        if engine is not None:
            try:
                value[0] = self.engine_absdiff(engine, expected)
            except Exception as e:  # noqa: BLE001 - every rank stops with the same line below
                value[0], cause = math.inf, f" (the engine failed to score it: {type(e).__name__}: {e})"
        if dist.is_initialized() and parallel.world_size() > 1:
            dist.broadcast(value, src=0)
        return self.verdict(float(value), step, cause)

    def verdict(self, diff: float, step: int, cause: str = "") -> float:
        """`diff`, or WeightSyncError above the tolerance."""
        if not diff <= self.tolerance:
            raise WeightSyncError(
                f"the rollout engine's weights differ from the actor's after the sync at step {step}: mean "
                f"|logprob difference| {diff:.3g} on the weight-sync probe, tolerance {self.tolerance:g} for "
                f"{self.dtype_name}{cause}")
        return diff

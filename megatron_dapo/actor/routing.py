"""MoE routing on the actor: what each router picked, replaying given picks, and how the two agree.

Every MoE layer's router gets its own `TrackedReplay` (megatron-core 0.16's `RouterReplay`, which
`moe_enable_routing_replay` makes the router consult for its top-k). Per micro-batch the actor either records
the experts each token went to (`record`) or replays given ones (`replay`): the router still scores every
expert, so the probabilities and their gradients are the model's, only the top-k set is fixed. Alongside, each
router counts how often its own top-k set equals the replayed one and how many tokens each expert received.

Routes are [tokens, layers, top_k] of a small integer dtype (uint8 up to 256 experts, else int16), in the order
the model sees its tokens: Megatron's hidden states are [sequence, batch], so a padded micro-batch's token
(row b, position s) is number s * rows + b; a thd sequence's tokens are in order. With sequence parallelism a
router sees its TP rank's slice of that order only (`tp_slice`).

actor.routing_replay: r2 replays, in the updates, the routes the pi_old pass recorded (the ratio's numerator
and denominator then use the same experts; Megatron-LM's R2). r3 replays the rollout engine's routes (Sample.routes:
every token it read, prompt included) in the pi_old pass and the updates: the policy is trained on the experts that
produced the samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_dapo import parallel
from megatron_dapo.types import route_dtype

if TYPE_CHECKING:
    from megatron_dapo.actor.model_spec import ModelSpec
    from megatron_dapo.actor.batching import MicroBatch
    from megatron_dapo.types import TrainBatch


REPLAY_LINES = {"none": "every pass routes by itself", "r2": "the updates take pi_old's experts",
                "r3": "pi_old and the updates take the rollout's experts, prompt included"}
"""actor.routing_replay, as the start-up summary says it."""


class TrackedReplay(RouterReplay):
    """Megatron's per-layer replay (record / replay a top-k), counting agreement and expert load. Not registered
    in RouterReplay's process-wide list: each actor drives its own model's routers."""

    def __init__(self, num_experts: int) -> None:  # no super().__init__(): it registers globally
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action: RouterReplayAction | None = None
        self.replay_backward_list: list[torch.Tensor] = []
        self.num_experts = num_experts
        self.compare_only = False
        """With REPLAY_FORWARD: count agreement with the target, but route by the router's own top-k."""
        self.counted = torch.zeros(0, dtype=torch.bool)
        self.tally = "update"
        """Which count the agreement with the target goes to: "update" or "rollout" (the rollout's routes)."""
        self.reset_counts()

    def reset_counts(self) -> None:
        self.counts = {"update": [0, 0], "rollout": [0, 0]}  # (agreeing, compared) (token, layer) pairs
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if self.target_topk_idx is not None and action in (RouterReplayAction.RECORD,
                                                           RouterReplayAction.REPLAY_FORWARD):
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self.target_topk_idx.to(scores.device).long()
            self.target_topk_idx = target
            same = (own.sort(-1).values == target.sort(-1).values).all(-1)
            counted = self.counted.to(scores.device)  # a row's tokens, not padding or a filler
            tally = self.counts[self.tally]
            tally[0] += int((same & counted).sum())
            tally[1] += int(counted.sum())
        if self.compare_only and action == RouterReplayAction.REPLAY_FORWARD:
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        else:
            probs, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        self.load += torch.bincount(idx.detach().flatten().cpu(), minlength=self.num_experts).double()
        return probs, idx


@dataclass
class RoutingStats:
    """Counts over the passes since the last `reset`: (token, layer) pairs whose own top-k equalled the given
    one, of all compared: in the updates (the routes they replay or compare with), and in a pass over the rollout's
    routes (pi_old's: replayed under r3, compared otherwise); tokens per expert of each layer."""

    agreeing: int
    replayed: int
    load: torch.Tensor
    """[layers, experts] float64."""
    rollout_agreeing: int = 0
    rollout_compared: int = 0

    def scalars(self) -> dict[str, float]:
        """moe/routing_agreement (when an update compared anything), moe/rollout_routing_agreement (when the
        rollout's routes were compared) and moe/expert_load_max_over_mean (the worst layer's busiest expert over
        its mean load; 1 = balanced)."""
        out: dict[str, float] = {}
        if self.replayed:
            out["moe/routing_agreement"] = self.agreeing / self.replayed
        if self.rollout_compared:
            out["moe/rollout_routing_agreement"] = self.rollout_agreeing / self.rollout_compared
        mean = self.load.mean(-1)
        busy = mean > 0
        if bool(busy.any()):
            out["moe/expert_load_max_over_mean"] = float((self.load.amax(-1)[busy] / mean[busy]).max())
        return out


class Routers:
    """The MoE routers of this rank's model (its pipeline stage's layers, in order) and their replays."""

    def __init__(self, model: torch.nn.Module, num_experts: int, top_k: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.top_k = top_k
        self.dtype = route_dtype(num_experts)
        self.replays: list[TrackedReplay] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = TrackedReplay(num_experts)
                self.replays.append(module.router_replay)
        RouterReplay.clear_global_router_replay_instances()  # Megatron's own, unused: we hold ours

    def __len__(self) -> int:
        return len(self.replays)

    def record(self, routes: torch.Tensor | None = None, counted: torch.Tensor | None = None,
               tally: str = "update") -> None:
        """Record the next forward's routes; with `routes` (as `replay`'s), also count how often they agree."""
        if routes is None:
            self._target(None, torch.zeros(0, dtype=torch.bool), tally)
        else:
            self._target(routes, counted, tally)
        self._act(RouterReplayAction.RECORD)

    def replay(self, routes: torch.Tensor, counted: torch.Tensor, compare_only: bool = False,
               tally: str = "update") -> None:
        """Replay `routes` [tokens, layers, top_k] in the next forward (the model's token order); `counted`
        [tokens] bool: the tokens whose agreement counts; `compare_only`: route freely, only counting how often
        the routers' own choice equals `routes`; `tally`: which count ("update" or "rollout")."""
        self._target(routes, counted, tally, compare_only)
        self._act(RouterReplayAction.REPLAY_FORWARD)

    def off(self) -> None:
        self._target(None, torch.zeros(0, dtype=torch.bool), "update")
        self._act(None)

    def recorded(self) -> torch.Tensor:
        """[tokens, layers, top_k] of the last recorded forward."""
        return torch.stack([r.recorded_topk_idx.to(self.dtype).cpu() for r in self.replays], 1)

    def stats(self) -> RoutingStats:
        def total(tally: str, i: int) -> int:
            return sum(r.counts[tally][i] for r in self.replays)

        return RoutingStats(total("update", 0), total("update", 1), torch.stack([r.load for r in self.replays]),
                            total("rollout", 0), total("rollout", 1))

    def reset(self) -> None:
        for r in self.replays:
            r.reset_counts()

    def _target(self, routes: torch.Tensor | None, counted: torch.Tensor, tally: str,
                compare_only: bool = False) -> None:
        if routes is not None and routes.shape[1:] != (len(self.replays), self.top_k):
            raise ValueError(f"routes of shape {tuple(routes.shape)} for {len(self.replays)} MoE layers of "
                             f"top-{self.top_k}")
        for layer, r in enumerate(self.replays):
            r.target_topk_idx = None if routes is None else routes[:, layer]
            r.compare_only, r.counted, r.tally = compare_only, counted, tally

    def _act(self, action: RouterReplayAction | None) -> None:
        for r in self.replays:
            r.router_replay_action = action
            r.replay_backward_list = []  # only activation recompute reads it, which replay refuses


def stage_routes(routes: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The rollout's routes of every layer [B, S, layers, k] -> this pipeline stage's layers (routes of this
    stage's layers as they are)."""
    from megatron_dapo.actor.hf_mapping import layer_range

    layers = layer_range(spec, parallel.pp_rank(), parallel.pp_size())
    if routes.shape[2] == len(layers):
        return routes
    if routes.shape[2] != spec.num_layers:
        raise ValueError(f"routes of {routes.shape[2]} layers for a model of {spec.num_layers}")
    return routes[:, :, layers.start:layers.stop]


def model_token_order(shape: tuple[int, int]) -> torch.Tensor:
    """For the model's [sequences, length] input: flat index (sequence * length + position) of the model's
    token i (Megatron's [length, sequences] order)."""
    n, length = shape
    return torch.arange(n * length).view(n, length).t().reshape(-1)


def tp_slice(tokens: int, tp_rank: int, tp_size: int) -> slice:
    """The tokens a router of TP rank `tp_rank` sees under sequence parallelism (the sequence dimension is
    split first, and it leads Megatron's order)."""
    per = tokens // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


def _row_positions(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index into the model's [sequences * length] input of each row position [rows, width], the row
    positions that hold a token [rows, width] bool)."""
    rows, width = mb.shape
    valid = torch.arange(width)[None, :] < mb.lengths[:, None]
    if mb.packed is None:
        return torch.arange(rows * width).view(rows, width), valid
    return mb.packed.gather, mb.packed.valid


def routes_to_rows(mb: MicroBatch, recorded: torch.Tensor) -> torch.Tensor:
    """A forward's routes [tokens, layers, k] in the model's order -> [rows, width, layers, k] of `mb`'s rows
    (0 past a row's end)."""
    flat = torch.empty_like(recorded)
    flat[model_token_order(mb.model_shape)] = recorded
    where, valid = _row_positions(mb)
    out = flat[where]
    out[~valid] = 0
    return out


def routes_to_model(mb: MicroBatch, routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mb`'s rows' routes [rows, width, layers, k] -> ([tokens, layers, k], [tokens] bool: a row's token whose
    agreement counts, every one but its last) in the model's order; positions that are no row's token (padding)
    get experts 0..k-1."""
    n, length = mb.model_shape
    k = routes.shape[-1]
    flat = torch.arange(k, dtype=routes.dtype).expand(n * length, routes.shape[2], k).clone()
    real = torch.zeros(n * length, dtype=torch.bool)
    where, valid = _row_positions(mb)
    routes = routes[:, : where.shape[1]]
    # A row's token t is the input at the position before its token t + 1's: in a shared-prefix unit that is
    # also each later row's own copy of the prompt's last token (its segment's start, which `where` skips).
    follows = valid[:, 1:]
    flat[(where[:, 1:] - 1)[follows]] = routes[:, :-1][follows]
    real[(where[:, 1:] - 1)[follows]] = True
    flat[where[valid]] = routes[valid]
    # a row's last token: no forward of the rollout read it (so it has no rollout route), and its output predicts
    # nothing the loss uses; its route is replayed but not counted
    ends = valid & (torch.arange(valid.shape[1])[None, :] == mb.lengths[:, None] - 1)
    real[where[valid & ~ends]] = True
    order = model_token_order(mb.model_shape)
    return flat[order], real[order]


class RouteKeeper:
    """The actor's side of routing: per pass a mode (record / replay / compare: route freely, counting agreement
    with the given routes / free), per micro-batch the routers set before its forward and its recorded routes
    taken after, and the moe/* monitors."""

    def __init__(self, model: torch.nn.Module, num_experts: int, top_k: int, *, sequence_parallel: bool) -> None:
        self.routers = Routers(model, num_experts, top_k)
        self.sp = sequence_parallel and parallel.tp_size() > 1
        self._mode: str | None = None
        self._tally = "update"

    @contextmanager
    def mode(self, mode: str | None, tally: str = "update") -> Iterator[None]:
        """One pass's mode; `tally`: where agreement with the given routes counts ("rollout": they are the
        rollout's)."""
        self._mode, self._tally = mode, tally
        try:
            yield
        finally:
            self._mode, self._tally = None, "update"
            self.routers.off()

    def before(self, mb: MicroBatch) -> None:
        """Set the routers for `mb`'s forward: record (counting agreement with mb.routes when it has them), replay
        mb.routes (a filler: experts 0..k-1), compare with them, or route freely."""
        if self._mode is None:
            self.routers.off()
            return
        if self._mode == "record" and (mb.routes is None or mb.filler):
            self.routers.record()
            return
        n, length = mb.model_shape
        k, layers = self.routers.top_k, len(self.routers)
        if mb.routes is None or mb.filler:
            routes, counted = torch.arange(k).expand(n * length, layers, k), torch.zeros(n * length, dtype=torch.bool)
        else:
            routes, counted = routes_to_model(mb, mb.routes)
        if self.sp:
            mine = tp_slice(n * length, parallel.tp_rank(), parallel.tp_size())
            routes, counted = routes[mine], counted[mine]
        if self._mode == "record":
            self.routers.record(routes if bool(counted.any()) else None, counted, self._tally)
        else:
            self.routers.replay(routes, counted, compare_only=self._mode == "compare" or not bool(counted.any()),
                                tally=self._tally)

    def after(self, mb: MicroBatch) -> None:
        """Keep `mb`'s recorded routes (its rows', all TP ranks' tokens) when recording."""
        if self._mode == "record" and not mb.filler:
            mb.recorded_routes = routes_to_rows(mb, self._gather_sequence(self.routers.recorded()))

    def batch_routes(self, batch: TrainBatch, micro: list[MicroBatch]) -> torch.Tensor:
        """[B, S, layers, k] from the micro-batches' recorded routes."""
        routes = torch.zeros(*batch.input_ids.shape, len(self.routers), self.routers.top_k, dtype=self.routers.dtype)
        for mb in micro:
            if mb.recorded_routes is not None:
                routes[mb.rows, : mb.shape[1]] = mb.recorded_routes
                mb.recorded_routes = None
        return routes

    def _gather_sequence(self, local: torch.Tensor) -> torch.Tensor:
        """A sequence-parallel rank's [tokens / TP, ...] -> every TP rank's, in order (else `local`)."""
        if not self.sp:
            return local
        parts = [torch.empty_like(local, dtype=torch.int32, device=parallel.device())
                 for _ in range(parallel.tp_size())]
        dist.all_gather(parts, local.to(parallel.device(), torch.int32), group=parallel.tp_group())
        return torch.cat(parts).to("cpu", local.dtype)

    def scalars(self) -> dict[str, float]:
        """Collective: the moe/* monitors since the last call, over all ranks."""
        stats = self.routers.stats()
        self.routers.reset()
        many = dist.is_initialized() and parallel.world_size() > 1
        sums = torch.tensor([stats.agreeing, stats.replayed, stats.rollout_agreeing, stats.rollout_compared],
                            dtype=torch.float64, device=parallel.device())
        load = torch.tensor([stats.scalars().get("moe/expert_load_max_over_mean", 0.0)], device=parallel.device())
        if many:
            dist.all_reduce(sums)
            dist.all_reduce(load, op=dist.ReduceOp.MAX)
        agreeing, replayed, rollout_agreeing, rollout_compared = (int(x) for x in sums.tolist())
        totals = RoutingStats(agreeing, replayed, torch.zeros(0, 0), rollout_agreeing, rollout_compared)
        return {"moe/expert_load_max_over_mean": float(load.item()), **totals.scalars()}  # the ratios of all ranks

"""The DAPO policy on Megatron-core: per-token logprobs/entropy and the token-level clipped update."""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import megatron_cpu, parallel
from megatron_dapo.actor.attention import attention_blocks
from megatron_dapo.actor.batching import MicroBatch, filler_micro_batch, micro_batches, split_rows
from megatron_dapo.actor.model import (
    ModelSpec,
    build_model,
    final_hidden_states,
    output_weight,
    packs_sequences,
    param_dtype,
    rotary_positions,
    use_transformer_engine,
)
from megatron_dapo.actor.routing import RouteKeeper, stage_routes
from megatron_dapo.actor.residency import Residency
from megatron_dapo.actor.optimizer import build_optimizer, build_scheduler, current_lr, wrap_ddp
from megatron_dapo.algo.loss_settings import LossSettings
from megatron_dapo.config import ActorConfig, AlgoConfig, ModelConfig, ParallelConfig
from megatron_dapo.config.sizing import resolve_micro_batches
from megatron_dapo.kernels import linear_logprobs_and_entropy, loss_from_logprobs, token_logprobs_and_entropy
from megatron_dapo.offload import HostOffload
from megatron_dapo.types import TrainBatch


class NonFiniteWeightsError(RuntimeError):
    """An optimizer step left inf/NaN in the weights, or blew them up (see MAX_GROWTH), or the weights
    give inf/NaN logits: training stops; such weights are never saved."""


MAX_GROWTH = 2.0
"""An update that more than doubles the largest |weight| of the model diverged: an AdamW step moves each weight
by about lr (at most 1, the paper 1e-6), far below the largest weight of any model that trains (norm scales
are about 1). An exploded update (lr 1e30, or lr * weight_decay >> 1) grows it by 1e20 and more while the
weights stay finite, and only some inputs then give inf/NaN logits: finiteness alone let them be saved."""


def _finalize_grads_unscaled(model, num_tokens=None, *args, **kwargs):
    """Megatron's grad finalisation (DP all-reduce, tied embeddings) without dividing by tokens."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, *args, **kwargs)


class Actor(Residency):
    """One rank's shard of the policy; every rank of a TP/PP/DP layout builds one."""

    def __init__(self, spec: ModelSpec, model_cfg: ModelConfig, par_cfg: ParallelConfig, actor_cfg: ActorConfig,
                 algo: AlgoConfig | None = None, *, temperature: float = 1.0, init_weights: bool = True,
                 max_response_len: int | None = None):
        """`algo`: the loss settings (variant, clip range, aggregation, entropy bonus; default the paper's).
        `temperature`: the rollout's sampling temperature; pi_old and pi_theta use logits / temperature,
        as the engine does (0 = greedy rollouts: plain logits). `max_response_len`: the rollout's L_max
        (Dr. GRPO's normaliser)."""
        self.spec = spec
        self.cfg = resolve_micro_batches(actor_cfg, spec.vocab_size, par_cfg.tensor_parallel,
                                         on_gpu=torch.cuda.is_available())  # 0 = sized from the vocabulary
        self.loss = LossSettings.from_config(algo if algo is not None else AlgoConfig(), max_response_len)
        self.temperature = temperature if temperature > 0 else 1.0
        model = build_model(spec, model_cfg, par_cfg, init_weights=init_weights)
        model.config.finalize_model_grads_func = _finalize_grads_unscaled
        self.ddp = wrap_ddp(model, distributed_optimizer=actor_cfg.optimizer.distributed_optimizer)
        self.bf16 = param_dtype(model_cfg) == torch.bfloat16
        self.optimizer = build_optimizer(self.ddp, actor_cfg.optimizer, bf16=self.bf16)
        self.scheduler = build_scheduler(self.optimizer, actor_cfg.optimizer)
        self.updates = 0
        self.loss_impl = actor_cfg.resolved_loss_impl(par_cfg.sequence_parallel)
        if self.loss_impl == "linear" and par_cfg.sequence_parallel:
            raise ValueError("actor.loss_impl=linear does not support parallel.sequence_parallel (use logits or auto)")
        self.shared_prefix = actor_cfg.resolved_shared_prefix(use_transformer_engine(model_cfg))
        self.thd = packs_sequences(model_cfg, par_cfg)
        self._sp_multiple = par_cfg.tensor_parallel if par_cfg.sequence_parallel else 1
        self.routing_replay = actor_cfg.routing_replay
        self.routes = RouteKeeper(self.module, spec.moe.num_experts, spec.moe.top_k,
                                  sequence_parallel=par_cfg.sequence_parallel) if spec.moe else None
        if self.routing_replay != "none" and (self.routes is None or model_cfg.recompute == "full"):
            why = "a MoE model" if self.routes is None else "model.recompute other than full (it routes again " \
                "in the backward)"
            raise ValueError(f"actor.routing_replay={self.routing_replay} needs {why}")
        self._offload = HostOffload()
        self._last_update = ""  # the last optimizer step that went through, for the divergence message

    @classmethod
    def from_hf(cls, hf_dir: str, model_cfg: ModelConfig, par_cfg: ParallelConfig, actor_cfg: ActorConfig,
                algo: AlgoConfig | None = None, *, temperature: float = 1.0,
                max_response_len: int | None = None) -> Actor:
        """Build the actor for this rank and load its shard of the HF checkpoint in `hf_dir`."""
        from megatron_dapo.actor.hf_io import SafetensorsReader, load_hf_weights
        from megatron_dapo.actor.model import load_hf_config, spec_from_hf

        spec = spec_from_hf(load_hf_config(hf_dir))
        actor = cls(spec, model_cfg, par_cfg, actor_cfg, algo, temperature=temperature, init_weights=False,
                    max_response_len=max_response_len)
        load_hf_weights(actor.module, SafetensorsReader(hf_dir), spec)
        actor.weights_loaded()
        return actor

    def weights_loaded(self) -> None:
        """The model's weights were written outside the optimizer (HF weights, a weights-only checkpoint):
        the bf16 optimizer's fp32 main copies, taken when it was built, are refreshed from them (else the
        first update continues from the uninitialised memory they were cloned from)."""
        self.optimizer.reload_model_params()

    @property
    def last_update(self) -> str:
        """The last optimizer step that went through: "update k: lr .., grad norm .." ("" before the first)."""
        return self._last_update

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (no DDP wrapper): parameter names match hf_mapping."""
        return self.ddp.module

    # --- logprobs --------------------------------------------------------------------------------

    def _token_stats(self, out: torch.Tensor, input_ids: torch.Tensor, entropy: bool = True,
                     temperature: float | None = None, needed: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last stage's output -> logprob of token t and entropy at t, as [b, s] (position 0 = 0).

        `out`: logits [b, s, V/TP] in the model's dtype (loss_impl=logits; the kernels read them in fp32
        chunks, divide by the temperature as they load, and write their gradient into their storage),
        or the final hidden states [b, s, H] (loss_impl=linear: the output layer is fused into the
        kernels, no logits tensor exists). With logits every position is computed (the last one's target
        is a dummy and its result dropped): slicing them would cost a full-size gradient in backward.
        With hidden states and `needed` ([b, s] bool), the output layer computes only the positions whose
        statistics are needed (the loss tokens, not the prompt); the others read 0."""
        targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
        if needed is not None and self.loss_impl == "linear":
            at = torch.cat([needed[:, 1:], torch.zeros_like(needed[:, :1])], 1).to(out.device)  # t predicts t + 1
            lp, ent = self._next_token_stats(out[at].unsqueeze(0), targets[at].unsqueeze(0), entropy, temperature)
            lp, ent = (None if t is None else t.new_zeros(at.shape).masked_scatter(at, t[0]) for t in (lp, ent))
        else:
            lp, ent = self._next_token_stats(out, targets, entropy, temperature)
        pad = lp.new_zeros(lp.shape[0], 1)
        return torch.cat([pad, lp[:, :-1]], 1), None if ent is None else torch.cat([pad, ent[:, :-1]], 1)

    def _next_token_stats(self, out: torch.Tensor, targets: torch.Tensor, entropy: bool, temperature: float | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob of `targets` [b, n] and entropy at each of `out`'s positions [b, n, V/TP or H]."""
        weight = output_weight(self.module) if self.loss_impl == "linear" else None
        v_local = out.shape[-1] if weight is None else weight.shape[0]
        start = parallel.tp_rank() * v_local
        valid = max(0, min(v_local, self.spec.vocab_size - start))  # Megatron's vocab padding is not vocabulary
        kw = {"tp_group": parallel.tp_group() if parallel.tp_size() > 1 else None, "vocab_start": start,
              "compute_entropy": entropy, "temperature": self.temperature if temperature is None else temperature}
        if weight is not None:
            return linear_logprobs_and_entropy(out, weight[:valid], targets, **kw)
        return token_logprobs_and_entropy(out, targets, vocab_valid=valid,
                                          inplace_backward=out.requires_grad and not out.is_leaf, **kw)

    def _row_stats(self, mb: MicroBatch, out: torch.Tensor, entropy: bool = True,
                   temperature: float | None = None, needed: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_token_stats` of the sequences the model computed for `mb`, as [rows, width] of its rows;
        `needed` ([sequences, length] bool): at those positions only (the rest read 0)."""
        lp, ent = self._token_stats(out, mb.model_ids.to(out.device), entropy, temperature, needed)
        return mb.to_rows(lp), None if ent is None else mb.to_rows(ent)

    def _forward(self, micro: list[MicroBatch], loss_func, forward_only: bool) -> list[Any]:
        megatron_cpu.enter_thread()
        if self.loss_impl == "linear":
            with final_hidden_states(self.module):
                return self._schedule(micro, loss_func, forward_only)
        return self._schedule(micro, loss_func, forward_only)

    def _schedule(self, micro: list[MicroBatch], loss_func, forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, pos, mask = (t if t is None else t.to(parallel.device()) for t in mb.model_inputs())
            blocks = None if mb.packed is None else mb.packed.blocks
            rotary = rotary_positions(self.module, pos if mb.rotates_by_position_ids else None)
            if self.routes is not None:
                self.routes.before(mb)
            with rotary, attention_blocks(blocks, tuple(ids.shape), ids.device):
                out = model(ids, pos, mask, **mb.model_kwargs(ids.device))
            if self.routes is not None:
                self.routes.after(mb)
            return out, partial(loss_func, mb)

        seq = max(m.model_shape[1] for m in micro)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.ddp],
            num_microbatches=len(micro), seq_length=seq, micro_batch_size=max(m.model_shape[0] for m in micro),
            forward_only=forward_only)

    def _routing(self, mode: str | None, tally: str = "update"):
        """The routers' mode for one pass (actor/routing.py's RouteKeeper): record, replay or free; `tally`
        "rollout": the batch's routes are the rollout's (moe/rollout_routing_agreement)."""
        return nullcontext() if self.routes is None else self.routes.mode(mode, tally)

    def routing_scalars(self) -> dict[str, float]:
        """Collective: moe/* monitors since the last call, over all ranks (empty for a dense model)."""
        return {} if self.routes is None else self.routes.scalars()

    def _micro_batches(self, batch: TrainBatch, token_budget: int) -> list[MicroBatch]:
        micro = micro_batches(batch, token_budget, shared_prefix=self.shared_prefix,
                              pair_cost=self.spec.attention_pair_cost(), thd=self.thd) if len(batch) else []
        return micro + [filler_micro_batch(self._sp_multiple) for _ in range(self._agree_on_count(len(micro)) - len(micro))]

    def _agree_on_count(self, count: int) -> int:
        """Collective over the expert-parallel group: the most micro-batches any of its ranks packed. Every
        micro-batch's forward and backward exchange tokens all-to-all across those ranks, so a rank with one
        more than the others would wait in a collective nobody joins (NCCL: until its timeout); the short ranks
        run fillers (filler_micro_batch) up to the agreed count."""
        if not (dist.is_initialized() and parallel.ep_size() > 1):
            return count
        agreed = torch.tensor([count], dtype=torch.int64, device=parallel.device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=parallel.ep_group())
        return int(agreed.item())

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, temperature: float | None = None,
                         responses_only: bool = False, record_routes: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs and entropies [B, S] of `batch` under the current policy (all ranks), at the
        rollout's temperature unless `temperature` is given. `responses_only`: at the generated tokens only
        (response_mask, else loss_mask; the rest read 0; loss_impl=linear's output layer skips the prompt).
        `record_routes` (a MoE model): also sets batch.routes, the experts this rank's layers sent each token to;
        under actor.routing_replay=r3 a batch that holds the rollout's routes replays them instead. With the
        rollout's routes, the routers count how often their own choice equals them (moe/rollout_routing_agreement)."""
        self._check_awake(("weights",))
        rollout_routes = batch.routes is not None and self.routes is not None  # the rollout's (collect, r3)
        if rollout_routes:
            batch.routes = stage_routes(batch.routes, self.spec)
        replay = rollout_routes and self.routing_replay == "r3"
        micro = self._micro_batches(batch, self.cfg.logprob_micro_batch_tokens)
        out_lp = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        out_ent = torch.zeros_like(out_lp)

        def collect(mb: MicroBatch, logits: torch.Tensor):
            if mb.filler:
                return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}
            needed = mb.model_response_mask() if responses_only else None
            lp, ent = self._row_stats(mb, logits, temperature=temperature, needed=needed)
            width = mb.shape[1]
            out_lp[mb.rows, :width] = lp.cpu()
            out_ent[mb.rows, :width] = ent.cpu()
            return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

        self.ddp.eval()
        recording = record_routes and not replay and self.routes is not None
        with self._routing("replay" if replay else "record" if recording else None,
                           "rollout" if rollout_routes else "update"):
            self._forward(micro, collect, forward_only=True)
        self.ddp.train()
        if recording:
            batch.routes = self.routes.batch_routes(batch, micro)
        if parallel.pp_size() > 1:
            for t in (out_lp, out_ent):
                dist.broadcast(t, parallel.last_stage_global_rank(), group=parallel.pp_group())
        if responses_only:  # loss_impl=logits computed every position
            out_lp, out_ent = out_lp * batch.generated(), out_ent * batch.generated()
        return out_lp, out_ent

    # --- the DAPO update ---------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, *, num_mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:
        """`epochs` x `num_mini_batches` optimizer updates on this DP rank's rows (needs old_logprobs): the
        updates' mean statistics, and the step's token counts over all DP ranks (`perf_scalars`)."""
        self._check_awake()
        if batch.old_logprobs is None:
            raise ValueError("train_step needs batch.old_logprobs (call compute_logprobs first)")
        if batch.routes is not None and self.routes is not None:
            batch.routes = stage_routes(batch.routes, self.spec)
        history, counts = [], torch.zeros(4, dtype=torch.float64)
        for _ in range(epochs):
            for mini in split_rows(batch, num_mini_batches):
                micro = self._micro_batches(mini, self.cfg.micro_batch_tokens)
                counts += torch.tensor([(*m.token_counts(), self._output_positions(m)) for m in micro],
                                       dtype=torch.float64).sum(0)
                history.append(self._update(mini, micro))
        out = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
        return {**out, **self._perf_scalars(counts), **self.routing_scalars()}

    def _output_positions(self, mb: MicroBatch) -> int:
        """Positions the update's output layer computes: the loss tokens' (loss_impl=linear), else all."""
        if self.loss_impl == "linear":
            return int(mb.model_loss_mask.sum())
        return mb.model_shape[0] * mb.model_shape[1]

    def _perf_scalars(self, counts: torch.Tensor) -> dict[str, float]:
        """Collective over DP. perf/trained_tokens: positions the updates computed (padding included);
        perf/pad_frac: the padding's share of them; perf/prefix_saved_frac: the share of the rows' tokens
        not computed because a group's rows shared their prompt (actor.shared_prefix; 0 when off);
        perf/output_tokens: the positions of them the output layer computed (the loss tokens')."""
        if dist.is_initialized() and parallel.dp_size() > 1:
            dist.all_reduce(counts, group=parallel.dp_group())
        computed, pad, rows, output = counts.tolist()
        return {"perf/trained_tokens": computed, "perf/pad_frac": pad / max(computed, 1.0),
                "perf/prefix_saved_frac": 1.0 - (computed - pad) / max(rows, 1.0), "perf/output_tokens": output}

    def _update(self, mini: TrainBatch, micro: list[MicroBatch]) -> dict[str, float]:
        counts = torch.tensor([float(mini.loss_mask.sum()), float((mini.loss_mask.sum(1) > 0).sum())])
        if dist.is_initialized() and parallel.dp_size() > 1:
            dist.all_reduce(counts, group=parallel.dp_group())
        global_tokens, global_seqs = counts.tolist()
        stats = torch.zeros(7, dtype=torch.float64)  # token sums: loss, tokens, clip hi/lo/dual, entropy, kl

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if mb.filler:  # in the graph, so its backward runs the all-to-alls too; adds 0 to every gradient
                return (logits * 0).sum(), torch.tensor(0, dtype=torch.int), {}
            dev = logits.device
            lp, ent = self._row_stats(mb, logits, entropy=True, needed=mb.model_loss_mask)
            is_weights = None if mb.is_weights is None else mb.is_weights.to(dev)
            loss, m = loss_from_logprobs(
                lp, ent, mb.old_logprobs.to(dev), mb.advantages.to(dev), mb.loss_mask.to(dev), self.loss,
                global_num_tokens=global_tokens, global_num_seqs=global_seqs, is_weights=is_weights, impl="auto")
            n = float(m.num_tokens)
            stats.add_(torch.tensor([float(loss.detach()), n, float(m.clipfrac_high) * n, float(m.clipfrac_low) * n,
                                     float(m.clipfrac_dual) * n, float(m.entropy) * n, float(m.approx_kl) * n],
                                    dtype=torch.float64))
            return loss, torch.tensor(int(n), dtype=torch.int), {}

        self.scheduler.step(1)  # warm-up counts this update: update k uses lr * (k+1) / warmup_steps
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        routing = None if mini.routes is None else "replay" if self.routing_replay != "none" else "compare"
        with self._routing(routing):
            self._forward(micro, loss_func, forward_only=False)
        metrics = self._reduce_stats(stats)
        if metrics["nonfinite"]:
            # NaN/Inf in the loss or any gradient: skip the update so nothing is corrupted
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            return {**metrics, "grad_norm": float("nan"), "update_ok": 0.0}
        before = self._largest_weight()
        ok, grad_norm, _ = self.optimizer.step()
        self.updates += 1
        self._last_update = (f"update {self.updates}: lr {current_lr(self.optimizer):g}, "
                             f"grad norm {float(grad_norm or 0.0):g}")
        self._check_update(before, self._largest_weight())
        return {**metrics, "grad_norm": float(grad_norm or 0.0), "update_ok": float(bool(ok))}

    def _check_update(self, before: float, after: float) -> None:
        """Raise NonFiniteWeightsError when the step left inf/NaN weights or grew the largest one more than
        MAX_GROWTH times (`before`, `after`: the largest |weight| of all ranks)."""
        if math.isfinite(after) and after <= MAX_GROWTH * before:
            return
        what = "left inf/NaN in the weights" if not math.isfinite(after) else \
            f"grew the largest weight from {before:.3g} to {after:.3g}"
        raise NonFiniteWeightsError(f"the last update diverged: it {what} ({self._last_update}); stopped before "
                                    f"its weights were synced or saved (lower actor.optimizer.lr?)")

    def _largest_weight(self) -> float:
        """Collective: the largest |weight| over all ranks (inf/NaN when a weight is); one reduction per tensor."""
        local = torch.stack([torch.linalg.vector_norm(p.detach(), ord=math.inf).float()
                             for p in self.module.parameters()]).amax()
        if torch.isnan(local):
            local = local.new_tensor(math.inf)  # the MAX reduction below would not carry a NaN
        local = local.reshape(1).to(parallel.device())
        if dist.is_initialized() and parallel.world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return float(local.item())

    def weights_finite(self) -> bool:
        """Collective: True when every rank's weights are finite (one fused reduction per tensor)."""
        sums = [p.detach().sum(dtype=torch.float32) for p in self.module.parameters()]
        bad = (~torch.isfinite(torch.stack(sums)).all()).float().reshape(1).to(parallel.device())
        if dist.is_initialized() and parallel.world_size() > 1:
            dist.all_reduce(bad)
        return not bool(bad.item())

    def _grads_finite(self) -> bool:
        return all(bool(torch.isfinite(buf.grad_data.sum())) for buf in self._buffers())

    def _buffers(self) -> list[Any]:
        """Megatron DDP's grad buffers: dense parameters, and routed experts (reduced over expert-DP) apart."""
        return [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]

    def _reduce_stats(self, stats: torch.Tensor) -> dict[str, float]:
        """Sum the token statistics over DP (from the last pipeline stage) and flag non-finite values."""
        stats = torch.cat([stats, torch.tensor([0.0 if self._grads_finite() else 1.0], dtype=torch.float64)])
        if dist.is_initialized() and parallel.world_size() > 1:
            if not parallel.is_last_stage():
                stats[:-1].zero_()  # loss terms live on the last pipeline stage
            dist.all_reduce(stats)
            stats[:-1] /= parallel.tp_size()  # every TP rank of the last stage holds the same sums
        loss, tokens, hi, lo, dual, ent, kl, bad_grads = stats.tolist()
        t = max(tokens, 1.0)
        nonfinite = bad_grads > 0 or not all(map(torch.isfinite, stats[:-1]))
        return {"loss": loss, "tokens": tokens, "clipfrac_high": hi / t, "clipfrac_low": lo / t,
                "clipfrac_dual": dual / t, "entropy": ent / t, "approx_kl": kl / t, "lr": current_lr(self.optimizer),
                "nonfinite": float(nonfinite)}


"""The planner's per-GPU memory model: parameter counts and activation bytes, pure arithmetic.

All sizes per GPU in bytes (GiB = 2**30 bytes); P = parameters on the GPU's pipeline stage,
sharded by TP, a MoE model's routed experts also split over EP (each GPU holds E / EP experts of every
layer of its stage, each expert TP-sharded); the worst stage counts. A phase is refused when it needs more than
--max-util (default 0.9) x GPU memory: the caching allocator fragments memory and small buffers are
not counted.
  train phase  = weights + main grads + optimizer + activations + reserve
    weights      bf16: 2 B x P            (model.dtype float32: 4 B)
    main grads   fp32: 4 B x P            (Megatron's grad buffer is full size, also with the
                                           distributed optimizer, which reduce-scatters into it)
    optimizer    12 B x P / DP            fp32 master copy + Adam m + v, sharded over DP with
                                          actor.optimizer.distributed_optimizer, else 12 B x P
                                          (float32 params: no master copy, 8 B); routed experts
                                          shard over their expert-data-parallel ranks, DP / EP
    activations  max(train micro-batch, logprob micro-batch), T = max(token budget, prompt+response)
                 tokens (a longer row goes alone into its micro-batch), a = 2 B (bf16):
       one layer, all tensors kept for backward (SwiGLU, GQA, flash attention, no dropout):
           A(T) = a x T x [ (2h + 2 kv hd + 3 ffn) / TP + 4h / (TP if sequence parallel else 1) ]
           (q,k,v + attention output + gate,up + SwiGLU out are TP-sharded; the inputs of the two
           RMSNorms, of QKV and of FC1 are replicated without SP)
       MoE layer: ffn = top_k x moe_ffn + shared expert ffn (each token runs through k experts), plus
           2 k h replicated (the dispatched token copies before and after the experts)
       recompute none/selective: layers_stage x in-flight x A(T) + A(T)   (selective recomputes
           only core attention, which flash attention does not store anyway)
       recompute full: layers_stage x in-flight x a x T x h / (TP if SP else 1) + 2 A(T)
           (checkpointed layer inputs + one layer recomputed in backward, with its gradients)
       in-flight micro-batches on stage i = PP - i (1F1B)
       last stage, the loss (actor.loss_impl, auto = linear unless sequence parallel):
         logits: logits T x V_padded / TP x a, plus their transposed copy / their gradient (a) when
           training (the streaming kernels keep no fp32 [T, V] copy, the gradient overwrites them)
         linear: no logits tensor; one token chunk of them (<= 2 GiB, LINEAR_CHUNK_BYTES of
           kernels/linear_logprobs.py) and the fp32 output-weight gradient 4 B x V_padded / TP x h
       logprob pass (forward only): A(T_lp) + the loss's forward part at T_lp
    reserve      --reserve-gb: CUDA contexts (trainer, the sleeping SGLang server), NCCL buffers
  generate phase (colocated SGLang awake; actor.offload_when_idle moves weights, grads and optimizer
  state to host memory, else they stay) = mem_fraction_static x GPU + actor resident + reserve
  sync phase = actor weights + main grads + optimizer + SGLang weights (no KV cache) + reserve
  (which components each phase holds: loop/colocation.py, the table the trainer follows too)
    SGLang static pool = engine weights (2 B x params / sglang TP) + KV pool
    KV bytes per token per GPU = 2 (K, V) x layers x KV heads per GPU x head_dim x 2 B (bf16)
       (KV heads per GPU = kv_heads / sglang TP, at least 1: replicated when TP > kv_heads)
    tokens in flight per engine = concurrent sequences x (max_prompt_len + max_response_len)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_dapo.config import Config
from megatron_dapo.config.sizing import resolve_micro_batches

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ActorBytes:
    """Bytes per parameter of the actor's state for one params dtype."""

    weights: int
    main_grads: int
    optimizer: int


def actor_bytes(cfg: Config) -> ActorBytes:
    if cfg.model.dtype == "float32":
        return ActorBytes(weights=4, main_grads=4, optimizer=8)  # no fp32 master copy
    return ActorBytes(weights=2, main_grads=4, optimizer=12)


def params_dtype(cfg: Config) -> str:
    return "float32" if cfg.model.dtype == "float32" else "bfloat16"  # auto = bf16 on GPU


def activation_bytes(cfg: Config) -> int:
    return 4 if cfg.model.dtype == "float32" else 2


# ------------------------------------------------------------------------------------- parameters


def layer_params(spec: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one transformer layer, routed experts apart (`expert_params`)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = h * (q + 2 * kv) + ((q + 2 * kv) if spec.qkv_bias else 0)
    mlp = 3 * h * (spec.ffn_hidden_size if spec.moe is None else spec.moe.shared_expert_size)
    replicated = 2 * h + (2 * spec.head_dim if spec.qk_norm else 0)  # RMSNorms (+ Qwen3's q/k norms)
    if spec.moe is not None:  # the router, the shared expert's sigmoid gate
        replicated += spec.moe.num_experts * h + (h if spec.moe.shared_expert_size else 0)
    return qkv + q * h + mlp, replicated  # QKV, output proj, SwiGLU gate+up and down


def expert_params(spec: ModelSpec) -> int:
    """Routed-expert parameters of one layer: E SwiGLU MLPs (0 for a dense model)."""
    return 0 if spec.moe is None else spec.moe.num_experts * 3 * spec.hidden_size * spec.moe.ffn_hidden_size


def total_params(spec: ModelSpec) -> int:
    """Parameters of the Hugging Face model (unpadded vocabulary)."""
    sharded, repl = layer_params(spec)
    embed = spec.vocab_size * spec.hidden_size
    head = 0 if spec.tied_embeddings else embed
    return spec.num_layers * (sharded + repl + expert_params(spec)) + embed + head + spec.hidden_size


def activated_params(spec: ModelSpec) -> int:
    """Parameters one token runs through: a MoE model's top-k of its routed experts (= total if dense)."""
    if spec.moe is None:
        return total_params(spec)
    idle = expert_params(spec) * (spec.moe.num_experts - spec.moe.top_k) // spec.moe.num_experts
    return total_params(spec) - spec.num_layers * idle


def stage_params(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> list[int]:
    """Parameters on ONE GPU of each pipeline stage (Megatron layout, padded vocabulary)."""
    sharded, repl = layer_params(spec)
    layers = spec.num_layers // pp
    vocab_shard = spec.padded_vocab_size(tp) * spec.hidden_size // tp
    out = []
    for stage in range(pp):
        n = layers * (sharded // tp + repl) + stage_expert_params(spec, tp, pp, ep)
        if stage == 0:
            n += vocab_shard  # word embeddings
        if stage == pp - 1:
            n += spec.hidden_size  # final norm
            if not spec.tied_embeddings or pp > 1:  # tied + PP>1: the last stage keeps a copy
                n += vocab_shard
        out.append(n)
    return out


def stage_expert_params(spec: ModelSpec, tp: int, pp: int, ep: int) -> int:
    """Routed-expert parameters on ONE GPU of a stage: E / EP experts per layer, each TP-sharded."""
    return spec.num_layers // pp * expert_params(spec) // (tp * ep)


# ------------------------------------------------------------------------------------ activations


@dataclass(frozen=True, kw_only=True)
class StageActivations:
    """Activation bytes of one pipeline stage's GPU for the two passes that hold them."""

    train: float
    logprob: float
    train_tokens: int
    logprob_tokens: int

    @property
    def peak(self) -> float:
        return max(self.train, self.logprob)


def layer_activation_bytes(spec: ModelSpec, tokens: int, tp: int, seq_parallel: bool,
                           act_bytes: int) -> float:
    """A(T): one layer's activations kept for backward (see the module docstring)."""
    h, kvhd, ffn = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    replicated = 4 * h
    if spec.moe is not None:
        ffn = spec.moe.top_k * spec.moe.ffn_hidden_size + spec.moe.shared_expert_size
        replicated += 2 * spec.moe.top_k * h
    sharded = 2 * h + 2 * kvhd + 3 * ffn
    return act_bytes * tokens * (sharded / tp + replicated / (tp if seq_parallel else 1))


LINEAR_CHUNK_BYTES = 2 << 30
"""kernels/linear_logprobs.LINEAR_CHUNK_BYTES["cuda"] (not imported: the planner needs no torch)."""


def logits_bytes(spec: ModelSpec, tokens: int, tp: int, act_bytes: int, *, with_grad: bool) -> float:
    return tokens * spec.padded_vocab_size(tp) / tp * act_bytes * (2 if with_grad else 1)


def loss_bytes(spec: ModelSpec, cfg: Config, tokens: int, *, with_grad: bool) -> float:
    """The loss's working set on the last stage (see the module docstring)."""
    tp, a = cfg.parallel.tensor_parallel, activation_bytes(cfg)
    if cfg.actor.resolved_loss_impl(cfg.parallel.sequence_parallel) == "logits":
        return logits_bytes(spec, tokens, tp, a, with_grad=with_grad)
    chunk = min(logits_bytes(spec, tokens, tp, a, with_grad=False), LINEAR_CHUNK_BYTES)
    weight_grad = 4 * spec.padded_vocab_size(tp) / tp * spec.hidden_size if with_grad else 0.0
    return chunk + weight_grad


def stage_activations(spec: ModelSpec, cfg: Config, stage: int) -> StageActivations:
    par = cfg.parallel
    tp, pp, sp = par.tensor_parallel, par.pipeline_parallel, par.sequence_parallel
    a = activation_bytes(cfg)
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    actor = resolve_micro_batches(cfg.actor, spec.vocab_size, tp, on_gpu=True)  # 0 = from the vocabulary
    t_train = max(actor.micro_batch_tokens, seq)
    t_lp = max(actor.logprob_micro_batch_tokens, seq)
    layers, in_flight = spec.num_layers // pp, pp - stage
    last = stage == pp - 1
    one_layer = layer_activation_bytes(spec, t_train, tp, sp, a)
    if cfg.model.recompute == "full":
        kept = layers * in_flight * a * t_train * spec.hidden_size / (tp if sp else 1) + 2 * one_layer
    else:
        kept = layers * in_flight * one_layer + one_layer
    train = kept + (loss_bytes(spec, cfg, t_train, with_grad=True) if last else 0.0)
    logprob = layer_activation_bytes(spec, t_lp, tp, sp, a) + (
        loss_bytes(spec, cfg, t_lp, with_grad=False) if last else 0.0)
    return StageActivations(train=train, logprob=logprob, train_tokens=t_train, logprob_tokens=t_lp)


# ------------------------------------------------------------------------------------------ SGLang


def kv_bytes_per_token(spec: ModelSpec, sglang_tp: int) -> tuple[int, int]:
    """(per engine, per GPU) bf16 K and V bytes of one token; KV heads replicate when TP > kv_heads."""
    per_engine = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    per_gpu = 2 * spec.num_layers * max(1, spec.num_kv_heads // sglang_tp) * spec.head_dim * 2
    return per_engine, per_gpu

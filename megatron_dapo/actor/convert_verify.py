"""`--verify` of the conversion tools: Megatron logits vs transformers' on a fixed token batch (fp32).

transformers is the independent reference; the Megatron side is a fresh model built with the local
layer spec and filled from the written (or read) distributed checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import torch

from megatron_dapo.actor.convert_checks import EXIT_OK, EXIT_VERIFY_FAILED
from megatron_dapo.actor.model import ModelSpec

VERIFY_SHAPE = (2, 32)  # batch x tokens of the fixed verification batch


def build_stage(spec: ModelSpec, dtype: str, tp: int, pp: int) -> torch.nn.Module:
    """This rank's GPTModel stage (local layer spec: same checkpoint keys as Transformer Engine)."""
    from megatron_dapo.actor.model import build_model
    from megatron_dapo.config import ModelConfig, ParallelConfig

    return build_model(spec, ModelConfig(dtype=cast(Any, dtype), transformer_impl="local"),
                       ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), init_weights=False)


def load_weights_only(model: torch.nn.Module, ckpt: Path) -> None:
    """Collective: read the model part of a dist checkpoint at this TP/PP (as load_checkpoint does)."""
    from megatron_dapo.actor.checkpoint import load_sharded

    state = load_sharded({"model": model.sharded_state_dict()}, ckpt, expected=model.state_dict().keys())
    model.load_state_dict(state["model"])


def verify_tokens(spec: ModelSpec) -> torch.Tensor:
    batch, seq = VERIFY_SHAPE
    g = torch.Generator().manual_seed(20260)
    return torch.randint(0, spec.vocab_size, (batch, min(seq, spec.max_position_embeddings)), generator=g)


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [b, s, vocab] of the transformers model in `hf_dir` (the independent reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(tokens).logits.float()
    del model
    return out


def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full fp32 logits [b, s, vocab] on the last pipeline stage (every TP rank), None on other stages."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dapo import megatron_cpu, parallel

    megatron_cpu.enter_thread()
    dev = parallel.device()
    result = {}

    def forward_step(data_iterator, m):
        ids = next(data_iterator).to(dev)
        pos = torch.arange(ids.shape[1], device=dev).expand_as(ids).contiguous()

        def keep(output):
            result["logits"] = output.detach().float()
            return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        return m(ids, pos, None), keep

    model.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                    model=[model], num_microbatches=1, seq_length=tokens.shape[1],
                                    micro_batch_size=tokens.shape[0], forward_only=True)
    if "logits" not in result:
        return None
    local = result["logits"]
    if dist.is_initialized() and parallel.tp_size() > 1:
        parts = [torch.empty_like(local) for _ in range(parallel.tp_size())]
        dist.all_gather(parts, local.contiguous(), group=parallel.tp_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size].cpu()


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, fraction of positions whose argmax agrees)."""
    diff = (got.double() - ref.double()).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
    return diff, agree


def report_verify(prog: str, diff: float, agree: float, n: int, tol: float, what: str) -> int:
    """Print the verdict line; EXIT_OK within `tol`, EXIT_VERIFY_FAILED above it or on NaN."""
    ok = diff <= tol and math.isfinite(diff)
    print(f"{prog}: verify {what}: max |logit diff| = {diff:.3e} (tolerance {tol:.0e}), "
          f"argmax agreement = {agree:.4f} over {n} tokens: {'OK' if ok else 'FAILED'}", flush=True)
    return EXIT_OK if ok else EXIT_VERIFY_FAILED

"""Megatron DDP wrapper, AdamW optimizer and the warm-up-then-constant learning-rate schedule."""

from __future__ import annotations

from typing import Any

import torch

from megatron_dapo.config import OptimizerConfig


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool) -> Any:
    """Megatron DDP with a contiguous fp32 grad buffer; grads are SUMMED over DP ranks.

    The model's TransformerConfig has calculate_per_token_loss=True, so Megatron neither averages
    over DP nor divides by the micro-batch count: our loss is already normalised by the global
    token count (DAPO token-mean), which makes the gradient independent of how it is split.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: Any, cfg: OptimizerConfig, *, bf16: bool) -> Any:
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = MegatronOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.distributed_optimizer)
    return get_megatron_optimizer(mcfg, [ddp_model])


def build_scheduler(optimizer: Any, cfg: OptimizerConfig) -> Any:
    """Linear warm-up from 0 over `warmup_steps` updates, then constant lr (the paper's schedule)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.lr, lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.warmup_steps + 1, lr_decay_style="constant", start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def current_lr(optimizer: Any) -> float:
    return float(optimizer.param_groups[0]["lr"])

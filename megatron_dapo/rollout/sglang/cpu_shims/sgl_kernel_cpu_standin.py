"""Pure-torch stand-in for the two `sgl_kernel` CPU ops SGLang's dense CPU path calls.

PyPI has no CPU build of sgl-kernel. On the dense path SGLang's CPU platform calls only these two
(mem_cache/allocation.py, kernels/ops/kvcache/cache_move.py); every layer we use falls back to its
`forward_native`. Any other op can be imported (some modules import them at load time) but raises
NotImplementedError when called.
Served as `sgl_kernel` by megatron_dapo_sglang_cpu's import hook, only when CUDA is absent.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th consecutive slice of out_cache_loc."""
    del pool_len  # rows of req_to_token already have this length
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer (base pointer, bytes per slot): copy slot src_loc[j] to slot tgt_loc[j]."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    slots = int(max(src.max().item(), tgt.max().item())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        buf[tgt] = buf[src]  # advanced indexing on the right copies first: safe for overlaps


def __getattr__(name: str):
    """Other ops are imported at module load on some code paths (speculative decoding, MoE, ...), so
    importing them must work; calling one fails loudly instead of computing something else."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in: megatron-dapo provides only the dense-path ops "
            "assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu. Use a model/feature on "
            "SGLang's native torch path, or install a CPU build of sgl-kernel."
        )

    missing_op.__name__ = name
    return missing_op

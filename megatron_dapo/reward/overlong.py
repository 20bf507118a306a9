"""DAPO overlong reward shaping (eq. 13) and overlong filtering (truncated samples leave the loss)."""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["soft_overlong_penalty", "overlong_filter_mask"]


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def soft_overlong_penalty(
    length: int, max_response_len: int, cache_len: int, factor: float = 1.0
) -> float:
    """DAPO eq. 13 with L_max = ``max_response_len`` (hard generation limit) and L_cache = ``cache_len``.

    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the buffer
    (L_max - L_cache < |y| <= L_max); -1 beyond L_max. The result is scaled by ``factor``.
    """
    length = _as_int(length, "length")
    max_response_len = _as_int(max_response_len, "max_response_len")
    cache_len = _as_int(cache_len, "cache_len")
    if max_response_len <= 0:
        raise ValueError(f"max_response_len must be > 0, got {max_response_len}")
    if not 0 < cache_len < max_response_len:
        raise ValueError(f"cache_len must be in (0, max_response_len={max_response_len}), got {cache_len}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor must be a finite number >= 0, got {factor}")
    expected_len = max_response_len - cache_len
    if length <= expected_len:
        return 0.0
    if length <= max_response_len:
        return (expected_len - length) / cache_len * factor
    return -1.0 * factor


def overlong_filter_mask(truncated: Any) -> Any:
    """Loss mask for DAPO overlong filtering: 0.0 for truncated samples, 1.0 otherwise.

    A torch tensor (any dtype, nonzero = truncated) gives a float32 tensor on the same device;
    any other iterable of flags gives ``list[float]``. torch is never imported here.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.is_tensor(truncated):
        return (truncated == 0).float()
    flags: Iterable[Any] = truncated
    return [0.0 if bool(flag) else 1.0 for flag in flags]

"""Row views of logits: [..., V] as a 3-D [A, B, V] view without copying, and token chunks of it.

Megatron emits logits as [S, B, V]; the actor transposes them to [B, S, V], which is not
contiguous. Reshaping that to [N, V] would copy N x V elements, so the kernels address rows
through two leading strides instead: flat row r = a * B + b (row-major, like `targets.flatten()`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def as_rows(logits: torch.Tensor) -> torch.Tensor:
    """A [A, B, V] view of `logits` [..., V]; copies only when >3-D leading dims cannot be merged."""
    if logits.dim() == 1:
        return logits.view(1, 1, -1)
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 3:
        return logits
    return logits.flatten(0, -3)


def row_chunks(rows: torch.Tensor, max_rows: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (first, end, view) over `rows` [A, B, V]: views of <= max(max_rows, 1) consecutive flat rows.

    Each view is 3-D ([a, B, V] or [1, b, V]) so that callers can also write into it.
    """
    num_a, num_b = rows.shape[:2]
    max_rows = max(max_rows, 1)
    if num_b <= max_rows:
        step = max_rows // num_b if num_b else num_a
        for a0 in range(0, num_a, max(step, 1)):
            a1 = min(a0 + step, num_a)
            yield a0 * num_b, a1 * num_b, rows[a0:a1]
        return
    for a in range(num_a):
        for b0 in range(0, num_b, max_rows):
            b1 = min(b0 + max_rows, num_b)
            yield a * num_b + b0, a * num_b + b1, rows[a : a + 1, b0:b1]

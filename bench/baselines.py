"""Baselines packtool's packer is measured against, written here from the published facts.

* :func:`numpy_dp_solve` / :func:`numpy_dp_pack`: the Molmo2 online packer's algorithm. A
  buffer of 48 samples; for every pack an exact 0/1 two-dimensional knapsack solved by a
  numpy-vectorized dynamic program over the full ``(items x tokens x crops)`` table
  (tokens quantized to ``ceil(tokens / 32)`` of a ``16384 / 32 = 512`` capacity, ``128``
  crops), value ``tokens + 30 * crops``, then a backtrack through the table; emit the pack,
  refill the buffer, and at the end re-solve until the buffer is empty.
* :func:`bfd_pack`: one-dimensional best-fit-decreasing by tokens with the ``binpacking``
  package (as ms-swift and Qwen's tools do), which ignores the vision capacity; callers
  count how many of its packs break it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MOLMO2", "numpy_dp_solve", "numpy_dp_pack", "bfd_pack"]

#: The Molmo2 SFT packing settings.
MOLMO2 = {"buffer_size": 48, "max_tokens": 16384, "token_granularity": 32, "max_crops": 128, "crop_weight": 30}


def numpy_dp_solve(w: np.ndarray, u: np.ndarray, v: np.ndarray, max_w: int, max_u: int) -> tuple[int, np.ndarray]:
    """Exact 2-D knapsack with the full numpy table ``dp[i, a, b]`` and a backtrack.

    ``dp[i + 1] = max(dp[i], shift(dp[i], w[i], u[i]) + v[i])``, one vectorized numpy step per item;
    item ``i`` is taken in the backtrack where ``dp[i + 1, a, b] != dp[i, a, b]``.

    Example:
        >>> numpy_dp_solve(np.array([3, 4, 5]), np.array([1, 1, 2]), np.array([3, 4, 5]), 8, 3)
        (8, array([ True, False,  True]))
    """
    n = len(w)
    dp = np.zeros((n + 1, max_w + 1, max_u + 1), dtype=np.int64)
    for i in range(n):
        dp[i + 1] = dp[i]
        wi, ui = int(w[i]), int(u[i])
        if wi <= max_w and ui <= max_u:
            cand = dp[i, : max_w + 1 - wi, : max_u + 1 - ui] + int(v[i])
            np.maximum(dp[i + 1, wi:, ui:], cand, out=dp[i + 1, wi:, ui:])
    chosen = np.zeros(n, dtype=bool)
    a, b = max_w, max_u
    for i in range(n - 1, -1, -1):
        if dp[i + 1, a, b] != dp[i, a, b]:
            chosen[i] = True
            a -= int(w[i])
            b -= int(u[i])
    return int(dp[n, max_w, max_u]), chosen


def numpy_dp_pack(tokens: np.ndarray, units: np.ndarray, max_tokens: int = 16384, max_units: int = 128,
                  granularity: int = 32, vision_weight: int = 30, buffer_size: int = 48) -> list[np.ndarray]:
    """The online buffer policy around :func:`numpy_dp_solve`; returns the packs as index arrays.

    Samples must fit on their own (the caller drops oversize ones first).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    units = np.asarray(units, dtype=np.int64)
    qw = -(-tokens // granularity)
    value = tokens + vision_weight * units
    cap_w = max_tokens // granularity
    packs: list[np.ndarray] = []
    buffer = np.zeros(0, dtype=np.int64)
    pos = 0
    n = len(tokens)
    while pos < n or len(buffer):
        if len(buffer) < buffer_size and pos < n:
            take = min(buffer_size - len(buffer), n - pos)
            buffer = np.concatenate([buffer, np.arange(pos, pos + take)])
            pos += take
        _, chosen = numpy_dp_solve(qw[buffer], units[buffer], value[buffer], cap_w, max_units)
        if not chosen.any():
            chosen[0] = True
        packs.append(buffer[chosen])
        buffer = buffer[~chosen]
    return packs


def bfd_pack(tokens: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Best-fit-decreasing on tokens alone (``binpacking.to_constant_volume``)."""
    import binpacking

    bins = binpacking.to_constant_volume({i: int(t) for i, t in enumerate(tokens)}, max_tokens)
    return [np.array(sorted(b.keys()), dtype=np.int64) for b in bins if b]

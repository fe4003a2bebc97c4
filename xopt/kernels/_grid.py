"""Grid and block-size arithmetic on the host, for the kernels' launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in recent Triton,
and each host call goes through ``ConstexprFunction.__call__`` (argument unwrapping, an
import): a cost POET-X's layer would pay many times per forward+backward. These are the
same integer functions, plain.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, as ``triton.cdiv``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of 2 that is ≥ ``n`` (1 for ``n ≤ 1``), as
    ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()

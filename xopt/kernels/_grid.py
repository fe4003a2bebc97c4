"""Grid and block-size arithmetic on the host, for the kernels' launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: each
host call goes through ``ConstexprFunction.__call__`` (argument unwrapping, an import),
and POET-X's layer made 16 of them per forward+backward (cProfile on the H100 machine,
bench/poet_probe/host_launch.py). These are the same integer functions, plain.
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

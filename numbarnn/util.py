"""Small arithmetic shared by host code (plans, drivers, the cpu backend); imports nothing from numbarnn.

Not for numba.cuda kernel or njit bodies: they write ``-(-a // b)`` inline (a call compiles differently).
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0: the tiles or blocks of b that cover a items."""
    return -(-a // b)

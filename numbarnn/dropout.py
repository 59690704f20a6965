"""Dropout constants and arithmetic that the reference and the kernels share (SPEC 6), in neither of them.

The kernels import nothing from `numbarnn.reference` (the oracle shares no code with what it checks): what
both need is here: Philox4x32-10's constants, the exact keep threshold, the key from (seed, seed2), the
element-index bounds and the inverted-dropout scale.  `numbarnn/reference/philox.py` explains Philox.
"""
from __future__ import annotations

import math
from fractions import Fraction

from .validation import check_float, check_int

#: Philox4x32 round multipliers (Random123 PHILOX_M4x32_0 / _1)
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
#: Weyl key bumps (Random123 PHILOX_W32_0 / _1: golden ratio, sqrt(3) - 1)
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
#: number of rounds of Philox4x32-10
PHILOX_ROUNDS = 10
#: the random integer compared with the threshold has 24 bits (x >> 8)
DROPOUT_BITS = 24

def dropout_threshold(p: float) -> int:
    """min(2**24, ceil(p * 2**24)), exactly (the float p is read as the exact rational it stores).

    p in [0, 1]: 0 -> 0 (keep all), 1 -> 2**24 (keep none), 0.5 -> 2**23.
    """
    p = check_float("p", p, 0.0, 1.0)
    return min(2 ** DROPOUT_BITS, math.ceil(Fraction(p) * 2 ** DROPOUT_BITS))


def dropout_key(seed: int, seed2: int) -> tuple[int, int]:
    """Philox key (k0, k1) = (seed2 mod 2**32, seed mod 2**32): low and high word of (seed << 32) | seed2.

    Any Python/NumPy integers are accepted, negative ones too (two's complement, mod 2**32).
    """
    seed = check_int("seed", seed)
    seed2 = check_int("seed2", seed2)
    return seed2 % 2 ** 32, seed % 2 ** 32


def check_mask_args(layer, T, B, W) -> tuple[int, int, int, int]:
    """Validate layer >= 1 and T, B, W >= 0, and that every element index n fits in uint64."""
    layer = check_int("layer", layer, minimum=1)
    T = check_int("T", T, minimum=0)
    B = check_int("B", B, minimum=0)
    W = check_int("W", W, minimum=0)
    if layer * T * B * W > 2 ** 64:  # the largest n is layer*T*B*W - 1
        raise ValueError(f"layer: expected layer*T*B*W <= 2**64 (element indices fit in uint64), "
                         f"got layer={layer}, T={T}, B={B}, W={W}")
    return layer, T, B, W



def dropout_scale(p: float) -> float:
    """Inverted dropout: kept values scale by 1/(1-p); p == 1 drops everything (scale unused)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


#: Philox counter word 2 of the zoneout masks (dropout's is 0): a stream of its own under the same key
ZONEOUT_STREAM = 1


def check_zoneout_mask_args(pseudo_layer, T, B, P) -> tuple[int, int, int, int]:
    """Validate pseudo_layer >= 0 and T, B, P >= 0, and that every zoneout element index fits in uint64."""
    pseudo_layer = check_int("pseudo_layer", pseudo_layer, minimum=0)
    T = check_int("T", T, minimum=0)
    B = check_int("B", B, minimum=0)
    P = check_int("P", P, minimum=0)
    if (pseudo_layer + 1) * T * B * P > 2 ** 64:
        raise ValueError(f"pseudo_layer: expected (pseudo_layer+1)*T*B*P <= 2**64 (element indices fit in uint64), "
                         f"got pseudo_layer={pseudo_layer}, T={T}, B={B}, P={P}")
    return pseudo_layer, T, B, P

"""Pieces every kernel module shares: compute types, activations, launch sizes, small utility kernels.

Compute types: float16 is stored as half and computed in float32; float32 and float64 compute in their own
type.  Constants are typed NumPy scalars (numba freezes them), because numba promotes
``float32 * 0.5`` (a Python float) to float64.

Device functions are ``inline="always"``: a kernel that calls a plain device function makes numba compile
it "for the current device", which needs a GPU; inlined, `compile_ptx(..., cc=(8, 0))` works anywhere.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import cuda, types
from numba.np.numpy_support import from_dtype

from .inline_copy import install as _install_inline_copy

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
DTYPES = ("float16", "float32", "float64")

#: the type of shared-memory indices in hot loops: numba wraps a negative *signed* index Python-style (a shift,
#: a mask and an add per access, and the wrapped address kept in a register), an unsigned one is a plain
#: address.  Measured in v3's k loop (python -m numbarnn.kernels.sass), as earlier in GEMM v4's registers.
U = np.uint64

# numba-cuda copies an inlined device function's IR one block at a time, each block dragging the whole scope along:
# most of the compile time of the big kernels.  inline_copy.py makes it one copy (the same PTX, byte for byte).
_install_inline_copy()

if SIMULATOR:
    # numba's CUDA simulator hands the threads of a block their static shared arrays without a lock (rarely two
    # threads get different arrays: a silently wrong result), polls its barrier, and runs cooperative grids of
    # one block only: numbarnn/kernels/simulator.py replaces those pieces, once, before any kernel runs
    from .simulator import install as _install_simulator_fix
    _install_simulator_fix()


def acc_dtype(dtype) -> np.dtype:
    """The compute (and carried-state) dtype for a storage dtype."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def nb(dtype):
    """numba scalar type of a NumPy dtype."""
    return from_dtype(np.dtype(dtype))


def arr(dtype, ndim: int, layout: str = "C"):
    """numba array type, for the explicit signatures the kernel report compiles."""
    return types.Array(nb(dtype), ndim, layout)


def step_signatures(dtype) -> tuple[tuple, tuple]:
    """numba signatures of every cell's step kernels: the driver calls them all with the same arguments.

    forward:  (s, lens, gx, bias, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms)
    backward: (s, lens, dy, y, h0, c0, acts, cs, Wp_fwd, Wp_rev, dh, dc, dgx, dgh, h_prev, dh_total, direct)
    State buffers (h, c, dh, dc, direct) are in the compute dtype; the rest in the storage dtype.
    """
    a, i32, i64 = str(acc_dtype(dtype)), arr("int32", 1), nb("int64")
    d = str(np.dtype(dtype))
    forward = (i64, i32, arr(d, 4), arr(d, 3), arr(d, 2), arr(d, 2), arr(a, 3), arr(a, 3), arr(a, 3), arr(d, 3),
               arr(d, 4), arr(d, 4), arr(d, 4))
    backward = (i64, i32, arr(d, 3), arr(d, 3), arr(d, 3), arr(d, 3), arr(d, 4), arr(d, 4), arr(d, 2), arr(d, 2),
                arr(a, 3), arr(a, 3), arr(d, 4), arr(d, 4), arr(d, 4), arr(d, 4), arr(a, 3))
    return forward, backward


def threads(n: int, gpu: int = 128, sim: int = 8, simulator: bool | None = None) -> int:
    """Threads per block for n work items in x: warp multiples on a GPU, a handful in the simulator.

    In the simulator blocks are smaller than the work with a partial last block whenever n allows it
    (n - 1 threads, at most `sim`: n = 3 runs as 2 + 1 with one idle thread), as on a GPU, so a wrong
    ``j >= H`` guard or a wrong ``blockIdx.x * blockDim.x + threadIdx.x`` cannot pass the tests.
    """
    if SIMULATOR if simulator is None else simulator:
        return max(1, min(n - 1, sim))
    return max(32, min(gpu, -(-n // 32) * 32))


def blocks(n: int, per_block: int) -> int:
    """Blocks of per_block threads covering n items (at least 1)."""
    return max(1, -(-n // per_block))


@functools.lru_cache(maxsize=None)
def activations(dtype):
    """(sigmoid, tanh, relu) device functions computing in acc_dtype(dtype); overflow-free (SPEC 2)."""
    f = acc_dtype(dtype).type
    half, zero = f(0.5), f(0.0)

    @cuda.jit(device=True, inline="always")
    def sigmoid(x):
        return half * math.tanh(half * x) + half      # = 1/(1+e^-x), no exp to overflow

    @cuda.jit(device=True, inline="always")
    def tanh(x):
        return math.tanh(x)

    @cuda.jit(device=True, inline="always")
    def relu(x):
        return zero if x <= zero else x                # NaN propagates (NaN <= 0 is False), as np.maximum

    return sigmoid, tanh, relu


# ---------------------------------------------------------------------------------------------------
# utility kernels (flat element-wise work; one thread per element)
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_cast_copy(src_dtype, dst_dtype):
    """dst[n] = src[n] converted: state buffers in and out of the compute dtype."""
    to = np.dtype(dst_dtype).type

    def cast_copy(
        src,   # [N] any float dtype
        dst,   # [N]
    ):
        n = cuda.grid(1)
        if n < dst.shape[0]:
            dst[n] = to(src[n])
    return cast_copy


@functools.lru_cache(maxsize=None)
def make_fill(dtype):
    value_t = np.dtype(dtype).type

    def fill(
        dst,     # [N]
        value,   # scalar
    ):
        n = cuda.grid(1)
        if n < dst.shape[0]:
            dst[n] = value_t(value)
    return fill


@functools.lru_cache(maxsize=None)
def make_swap01(dtype):
    """out[j, i, k] = a[i, j, k]: batch-major <-> time-major as a real transpose (SPEC 3)."""
    def swap01(
        a,     # [A0, A1, K]
        out,   # [A1, A0, K]
    ):
        n = cuda.grid(1)
        A0, A1, K = a.shape[0], a.shape[1], a.shape[2]
        if n < A0 * A1 * K:
            k = n % K
            j = (n // K) % A1
            i = n // (K * A1)
            out[j, i, k] = a[i, j, k]
    return swap01


@functools.lru_cache(maxsize=None)
def jit(factory, *key):
    """The cached cuda.jit kernel of factory(*key): compiled once per specialisation and argument types."""
    return cuda.jit(factory(*key))


def kernel_specs():
    specs = []
    for dt in DTYPES:
        flat = arr(dt, 1)
        specs.append(("fill", dt, make_fill(dt), (flat, nb(dt)), 128))
        specs.append(("swap01", dt, make_swap01(dt), (arr(dt, 3), arr(dt, 3)), 128))
        acc = str(acc_dtype(dt))
        specs.append((f"cast_copy_to_{acc}", dt, make_cast_copy(dt, acc), (flat, arr(acc, 1)), 128))
        if acc != dt:
            specs.append((f"cast_copy_from_{acc}", dt, make_cast_copy(acc, dt), (arr(acc, 1), flat), 128))
    return specs

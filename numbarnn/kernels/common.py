"""Pieces every kernel module shares: compute types, activations, launch sizes, small utility kernels.

Compute types: float16 is stored as half and computed in float32; float32 and float64 compute in their own
type.  Constants are typed NumPy scalars (numba freezes them), because numba promotes
``float32 * 0.5`` (a Python float) to float64.

Device functions are `device`: compiled once per argument types, inlined by NVVM (`forceinline`), and
compilable with no GPU present (`device` says how and what it saves).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types
from numba.cuda import dispatcher
from numba.cuda.cudadrv.error import CudaSupportError
from numba.np.numpy_support import from_dtype

from ..util import cdiv
from . import target

#: whether this process runs numba's CUDA simulator (fixed at import; what the plans assume is `target.current()`)
SIMULATOR = target.PROCESS.simulator
DTYPES = ("float16", "float32", "float64")

#: the type of shared-memory indices in hot loops: numba wraps a negative *signed* index Python-style (a shift,
#: a mask and an add per access, and the wrapped address kept in a register), an unsigned one is a plain
#: address.  Measured in v3's k loop (python -m numbarnn.analysis.sass), as earlier in GEMM v4's registers.
U = np.uint64


def device(fn):
    """``@device``: `fn` as a CUDA device function that NVVM inlines into every kernel calling it
    (``cuda.jit(device=True, forceinline=True)``; in the simulator a plain ``device=True`` function).

    Why not numba's own ``inline="always"`` (what the kernels used before): numba inlines those in its IR,
    copying the callee and re-running its untyped passes at every call site of every kernel, nested helpers
    included; a device function is typed and lowered once per argument types and reused by every kernel of the
    process (the factories' lru_caches hand the same helpers to many kernels), and NVVM inlines it.  The kernel
    report (``time python -m numbarnn.analysis.report --json``, 392 kernels x sm_80/sm_90, 2 processes on 2
    cores): 7m41s -> 5m38s, 15m02s -> 10m12s of CPU; registers the same in 767 of 784 rows (13 more, by 2 to 16;
    4 fewer, by 2 to 28), no spills, no call left (``report.functions_left``).

    A kernel calling a device function makes numba compile it "for the current device", which asks the CUDA
    driver: `_compile_without_a_gpu` answers for a machine with none (the kernel report, CI)."""
    if SIMULATOR:                        # the simulator's cuda.jit has no forceinline
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


class _NoGPU:
    """What numba-cuda's dispatcher is told the current device is where there is no GPU: sm_80, the oldest
    architecture numbarnn reports.  A device function's cc only picks a few lowerings (float64 atomics from
    sm_60, some libdevice choices), the same on sm_80 and sm_90; NVVM compiles the linked kernel for the cc
    `compile_ptx` was given."""

    compute_capability = (8, 0)
    name = "no GPU (numbarnn's stand-in: device functions compiled for sm_80)"


def _compile_without_a_gpu() -> None:
    """numba-cuda's ``Dispatcher.compile_device`` reads ``get_current_device().compute_capability``, which raises
    CudaSupportError where there is no driver, so ``compile_ptx`` of a kernel calling a device function failed
    without a GPU.  Where the driver is missing, the dispatcher's get_current_device returns `_NoGPU` instead;
    with a GPU it is numba's own.  Only numba-cuda's dispatcher module sees this (`cuda.get_current_device()`
    still raises without a GPU), and it is installed once per process."""
    real = getattr(dispatcher, "get_current_device", None)
    if real is None or getattr(real, "numbarnn_real", None) is not None:   # another numba-cuda, or done already
        return

    def get_current_device():
        try:
            return real()
        except CudaSupportError:
            return _NoGPU

    get_current_device.numbarnn_real = real
    dispatcher.get_current_device = get_current_device


if not SIMULATOR:
    _compile_without_a_gpu()

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
    if target.simulator(simulator):
        return max(1, min(n - 1, sim))
    return max(32, min(gpu, cdiv(n, 32) * 32))


def blocks(n: int, per_block: int) -> int:
    """Blocks of per_block threads covering n items (at least 1)."""
    return max(1, cdiv(n, per_block))


@functools.lru_cache(maxsize=None)
def activations(dtype):
    """(sigmoid, tanh, relu) device functions computing in acc_dtype(dtype); overflow-free (SPEC 2)."""
    f = acc_dtype(dtype).type
    half, zero = f(0.5), f(0.0)

    @device
    def sigmoid(x):
        return half * math.tanh(half * x) + half      # = 1/(1+e^-x), no exp to overflow

    @device
    def tanh(x):
        return math.tanh(x)

    @device
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
def make_put4(dtype):
    """dst[0:4] = (v0, v1, v2, v3): four values written by a launch, not by a copy from host memory (a copy
    from pageable memory waits for the device first; the reserve's nonce is written at every training call)."""
    value_t = np.dtype(dtype).type

    def put4(
        dst,                 # [4]
        v0, v1, v2, v3,      # scalars
    ):
        if cuda.grid(1) == 0:
            dst[0] = value_t(v0)
            dst[1] = value_t(v1)
            dst[2] = value_t(v2)
            dst[3] = value_t(v3)
    return put4


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
        specs.append(("put4", dt, make_put4(dt), (flat,) + (types.float64,) * 4, 32))
        acc = str(acc_dtype(dt))
        specs.append((f"cast_copy_to_{acc}", dt, make_cast_copy(dt, acc), (flat, arr(acc, 1)), 128))
        if acc != dt:
            specs.append((f"cast_copy_from_{acc}", dt, make_cast_copy(acc, dt), (arr(acc, 1), flat), 128))
    return specs

"""A cell's pointwise math as fused numba.njit step loops (the CPU twins of `numbarnn/kernels/cell_steps.py`).

The cell's `forward` / `backward` are plain scalar Python (numbarnn.cells.spec).  `njit_function` compiles
them with every helper they call (sigmoid, tanh, ...) rebound to an njit twin computing in the compute dtype
(`numbarnn.cells.functions.compile_with_twins`, the mechanism the CUDA kernels' `device_function` uses).
The step loops below call them once per (active row b, unit j):

    forward_step:   wx[g] = gx[t, b, g*H+j] + bW[g*H+j] ; rh[g] = gh[b, g*H+j] + bR[g*H+j]
                    m, c' = cell.forward(wx, rh, v, h[b, j], c[b, j], saved)
                    saved -> acts[t, b] ; c' -> c, cs[t, b] ; m -> h, y[t, b] (or -> m_step, ms[t, b] to project)
    backward_step:  dm = dy[t, b, dP+j] + dh[b, j] (projection: dm from BLAS, W_proj^T (dy + dh))
                    dh_direct, dc_prev = cell.backward(dm, dc[b, j], saved, v, h, c, c', dwx, drh, dv)
                    dwx -> dgx[t, b] ; drh (split gates) or dwx -> dgh_s[b] ; dv -> dv_acc[b] ; dc_prev -> dc

`t = s` (forward direction) or `len[b]-1-s` (reverse), row b active iff s < len[b].  The backward runs the
rows it is given (`rows`: all of them, or one row group of the fused loop, `fused.py`).

Vectorized: a row's H units are taken in chunks of UNITS.  A chunk's inputs are gathered into scratch arrays
on the stack ([G, UNITS] etc., `stack_buffer`), the cell runs once per lane u (unit j0+u) reading and writing
only that scratch, and the results are scattered back.  Every loop is indexed only by its counter, so LLVM
vectorizes them (AVX: 8 or 16 units per instruction); indexing the big arrays at g*H+j directly, or the small
arrays allocated with np.empty, keeps it scalar (possible aliasing, negative-index checks): measured LSTM
B=32 H=512 float32, 100 forward steps, one core: 74 ms scalar, 14 ms vectorized.

Caching: ``cache=True`` everywhere (here, `fused.py`, `network.py`, `block_lstm.py`), with numba's cache index
locked across processes (`jitcache.py`: two processes compiling at once could otherwise leave one variant's
machine code filed under another's key).  The per-cell step loops
are closures made at run time; `cached_step` keeps their closure to plain values plus a fingerprint of the
cell's code and of the library sources they compile in (`variant_key`, `sources_fingerprint`), which is what
numba keys a cached closure by, so a new process loads them (measured cold compile and warm load: see
bench/results/cpu.md), and an edit to any file of numbarnn/cpu or numbarnn/cells compiles them again.
"""
from __future__ import annotations

import functools
import hashlib
import math
import pathlib
import types as pytypes

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..cells import HELPERS
from ..cells.functions import compile_with_twins
from . import threads
from .jitcache import njit_cached

#: below this many (row, unit) pairs per step the serial twin of a step loop runs (no parallel region).
#: Measured on 2 cores (LSTM B=32 H=512, 100 steps): the serial loop 47 ms, the prange loop 94 ms: numba's
#: workers and OpenBLAS's (spinning after every per-step matmul) fight for the same cores, so a parallel
#: region pays only for very wide steps.
PARALLEL_MIN_WORK = 1 << 20

# float32 tanh as Eigen's rational approximation (generic_fast_tanh_float: odd degree-13 / even degree-6
# polynomials, |x| clamped to 7.905..., where float32 tanh is 1): no libm call in the loop, max abs error
# 3.3e-7 measured over [-10, 10] (SPEC 10 float32 allows 1e-5); NaN propagates (comparisons are False).
_F32_ALPHA = tuple(np.float32(v) for v in (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
                                           5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
                                           -2.76076847742355e-16))
_F32_BETA = tuple(np.float32(v) for v in (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
                                          1.19825839466702e-06))
_F32_CLAMP = np.float32(7.90531110763549805)


@njit(inline="always")
def tanh_f32(x):
    """tanh for float32 without libm (see above)."""
    a1, a3, a5, a7, a9, a11, a13 = _F32_ALPHA
    b0, b2, b4, b6 = _F32_BETA
    if x > _F32_CLAMP:
        x = _F32_CLAMP
    elif x < -_F32_CLAMP:
        x = -_F32_CLAMP
    x2 = x * x
    p = x2 * a13 + a11
    p = x2 * p + a9
    p = x2 * p + a7
    p = x2 * p + a5
    p = x2 * p + a3
    p = x2 * p + a1
    q = x2 * b6 + b4
    q = x2 * q + b2
    q = x2 * q + b0
    return x * p / q


@njit(inline="always")
def tanh_libm(x):
    return math.tanh(x)


def compute_dtype(dtype) -> np.dtype:
    """float64 computes in float64; float32 and float16 in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.cache
def helpers(compute: str) -> dict:
    """numbarnn.cells helper -> its njit twin computing in `compute` (typed constants: numba would promote
    ``float32 * 0.5`` to float64).  tanh: `tanh_f32` in float32, libm in float64."""
    f = np.dtype(compute).type
    zero, half, one = f(0.0), f(0.5), f(1.0)
    th = tanh_f32 if np.dtype(compute) == np.float32 else tanh_libm

    @njit(inline="always")
    def sigmoid(x):
        return half * th(half * x) + half             # = 1/(1+e^-x), no exp to overflow

    @njit(inline="always")
    def tanh(x):
        return th(x)

    @njit(inline="always")
    def relu(x):
        return zero if x <= zero else x                # NaN propagates, as np.maximum  # noqa: FURB136

    @njit(inline="always")
    def dsigmoid(s):
        return s * (one - s)

    @njit(inline="always")
    def dtanh(t):
        return one - t * t

    @njit(inline="always")
    def drelu(r):
        return one if r > zero else zero

    @njit(inline="always")
    def one_minus(x):
        return one - x

    twins = {"sigmoid": sigmoid, "tanh": tanh, "relu": relu, "dsigmoid": dsigmoid, "dtanh": dtanh,
             "drelu": drelu, "one_minus": one_minus}
    return {HELPERS[name]: twin for name, twin in twins.items()}


def njit_function(fn, compute: str):
    """`fn` (a cell's plain Python pointwise function) as an inlined njit function computing in `compute`."""
    return compile_with_twins(fn, helpers(compute), njit(inline="always"))


#: units per chunk of a row: the lanes of the scratch arrays below (stack memory, G*UNITS values each)
UNITS = 128


@functools.cache
def stack_buffer(n: int):
    """An njit intrinsic ``stack_buffer(n)(dtype)`` -> a pointer to n values of `dtype` on the stack of the compiled
    function (one alloca in its entry block, however often the call runs); wrap it as an array with
    ``numba.carray(ptr, shape)``.  Unlike np.empty it is not a heap object, so LLVM knows it aliases nothing:
    the pointwise loop over a chunk, reading and writing only such scratch, vectorizes without runtime checks."""
    @intrinsic
    def pointer(typingctx, dtype):
        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, context.get_value_type(dtype.dtype), size=n)
        return types.CPointer(dtype.dtype)(dtype), codegen
    return pointer


@njit(inline="always")
def load(dst, src, n):
    """dst[:n] = src[:n] (a loop indexed only by its counter, which LLVM vectorizes)."""
    for u in range(n):
        dst[u] = src[u]


@njit(inline="always")
def load_sum(dst, a, b, n):
    """dst[:n] = a[:n] + b[:n]."""
    for u in range(n):
        dst[u] = a[u] + b[u]


@njit(inline="always")
def accumulate(dst, src, n):
    """dst[:n] += src[:n]."""
    for u in range(n):
        dst[u] += src[u]


# Set per compiled step loop (`cached_step` rebinds them in a copy of this module's globals): the cell's
# pointwise function (`njit_function`) and the stack scratch of its sizes (`stack_buffer`).
pointwise = lanes_G = lanes_S = lanes_V = lanes = None


def cached_step(step, parallel: bool, pointwise_fn, G: int, S: int, VL: int, U: int, *, fastmath=False, **extra):
    """`step` (a step loop closure) compiled with ``cache=True``, its globals `pointwise` and `lanes_*` bound
    (and any `extra` globals: the fused loop's micro-kernel and scratch, `fused.py`).

    numba keys an on-disk cache entry by the function's bytecode and its pickled closure values, not by its
    globals; the closure holds plain values only (sizes, flags and KEY, the fingerprint of the cell's code and
    the variant, `variant_key`), so every cell, dtype and variant gets its own entry and a new process loads
    the machine code instead of compiling it again (seconds per loop).  A change to any file of numbarnn/cpu or
    numbarnn/cells changes every KEY (`sources_fingerprint`): numba itself would only notice the loop's own file.
    Each variant gets its own qualified name (`variant_name`).  error_model="numpy": x / 0 gives inf/nan as in
    NumPy; numba's default ZeroDivisionError check would keep the pointwise loops from vectorizing.  fastmath:
    numba's flag (the row reductions' {"reassoc"}: sums that vectorize).  nogil: a loop releases the GIL, so two
    pieces of one call can run on several Python threads (`threads.team`)."""
    for name, value in zip(step.__code__.co_freevars, step.__closure__ or ()):
        if not _plain(value.cell_contents):
            raise TypeError(f"{step.__qualname__}: its closure value {name!r} is a "
                            f"{type(value.cell_contents).__name__}, which numba's cache cannot key (a compiled "
                            "function pickles differently in every process: the loop would compile in each); "
                            "pass it as a global (`extra`)")
    globals_ = dict(step.__globals__, pointwise=pointwise_fn, lanes_G=stack_buffer(G * U),
                    lanes_S=stack_buffer(S * U), lanes_V=stack_buffer(VL * U), lanes=stack_buffer(U), **extra)
    fn = pytypes.FunctionType(step.__code__, globals_, step.__name__, None, step.__closure__)
    fn.__qualname__, fn.__module__ = variant_name(step), step.__module__
    return njit_cached(fn, parallel=parallel, error_model="numpy", fastmath=fastmath,   # jitcache.py: safe in parallel
                       nogil=True)


def _plain(value) -> bool:
    """A value that keys numba's on-disk cache the same in every process: numbers, strings, flags, dtypes and
    scalar types, arrays, and tuples of them (not functions or dispatchers)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (int, float, str, bytes, np.generic, np.dtype, np.ndarray)) or \
        (isinstance(value, type) and issubclass(value, np.generic))


def variant_name(fn, key: str | None = None) -> str:
    """fn's qualified name with a digest of its variant (`key`, else its closure's values) appended.

    Why: numba names a compiled function's symbol by module, qualified name, argument types and a counter of the
    compiling process, and a cached loop's machine code brings the symbols of what it calls (a row group's
    function, a row loop) into the process that loads it, where the first definition of a name wins.  Two
    variants of one closure (two cells, same dtype) compiled in different orders by two processes could share a
    symbol, and a parallel loop loaded from the cache then called the other cell's group (seen: wrong outputs in
    a pytest-xdist worker).  With the variant in the name, equal names mean equal code."""
    h = hashlib.sha256()
    if key is not None:
        h.update(key.encode())
    else:
        for cell in fn.__closure__ or ():
            h.update(repr(cell.cell_contents).encode())
    return f"{fn.__qualname__}_{h.hexdigest()[:16]}"


def _hash_code(code, h):
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            _hash_code(const, h)
        else:
            h.update(repr(const).encode())


def _hash_function(fn, h, seen):
    """Hash `fn`'s code and, recursively, every function and simple constant it reads by global name (what
    `compile_with_twins` compiles in): a user cell's helper changes the fingerprint too."""
    if fn in seen:
        return
    seen.add(fn)
    _hash_code(fn.__code__, h)
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if any(value is helper for helper in HELPERS.values()):
            h.update(f"helper {name}".encode())          # their twins live in this file
        elif isinstance(value, pytypes.FunctionType):
            _hash_function(value, h, seen)
        elif isinstance(getattr(value, "py_func", None), pytypes.FunctionType):
            _hash_function(value.py_func, h, seen)
        elif isinstance(value, (bool, int, float, str, tuple)):
            h.update(f"{name}={value!r}".encode())


@functools.cache
def sources_fingerprint() -> str:
    """A hash of the library code the compiled loops are made of: every .py file of numbarnn/cpu and
    numbarnn/cells (the loops, the micro-kernel, the helpers they inline, the helpers' twins, the built-in
    cells).  numba invalidates a cached function when ITS file changes, not when a function it compiles in
    from another file does: before this, an edit to the sigmoid twin in this file left fused.py's cached
    loops running the old machine code (checked in a copy of the package: the same output after making
    sigmoid a constant)."""
    h = hashlib.sha256()
    for package in (pathlib.Path(__file__).parent, pathlib.Path(__file__).parent.parent / "cells"):
        for path in sorted(package.glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def variant_key(cell, compute: str, has_proj: bool, parallel: bool) -> str:
    """A fingerprint of a step loop variant: the cell's description and code (every function it gives: forward,
    backward, modulation, output and their backwards), the compute dtype and flags, and the library sources the
    loop compiles in (`sources_fingerprint`)."""
    h = hashlib.sha256(repr((cell.name, cell.gates, cell.saved, cell.vectors, cell.split_recurrent,
                             cell.cell_state, compute, has_proj, parallel, UNITS, sources_fingerprint())).encode())
    seen = set()
    for fn in (cell.forward, cell.backward, cell.modulation, cell.modulation_backward, cell.output,
               cell.output_backward):
        if fn is not None:
            _hash_function(fn, h, seen)
    return h.hexdigest()


@functools.cache
def forward_step(cell, compute: str, has_proj: bool, parallel: bool):
    """The fused pointwise forward of one step, one direction (see the module docstring)."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    U = UNITS
    STATE = cell.cell_state
    PROJ = has_proj
    KEY = variant_key(cell, compute, has_proj, parallel)

    def step(
        s,        # int     step index
        d,        # int     direction (0 forward, 1 reverse)
        lens,     # [B]     int32 sequence lengths
        gx,       # [T, B, G*H]   W x_t (no bias), this direction
        gh,       # [B, G*H]      R h of this step (no bias), every row
        bW,       # [G*H]
        bR,       # [G*H]
        vec,      # [V, H]        cell vectors ([0, H] without)
        h,        # [B, P]        state h, updated in place for active rows (no projection)
        c,        # [B, H]        state c, updated in place (cells with a state)
        m_step,   # [B, H]        out (projection): m, the projection's input
        y,        # [T, B, D*P]   layer output (no projection)
        acts,     # [T, B, S*H]   reserve: saved values
        cs,       # [T, B, H]     reserve: c'
        ms,       # [T, B, H]     reserve: m (projection)
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cached_step)
        B = h.shape[0]
        P = h.shape[1]
        H = gx.shape[2] // G
        for b in prange(B):
            if s >= lens[b]:                    # past the length: carry the state, no output
                continue
            t = s if d == 0 else lens[b] - 1 - s
            # scratch for one chunk of U units, lane u = unit j0+u (stack memory, see stack_buffer)
            wx = numba.carray(lanes_G(acc), (G, U))      # [G, U] W_g x + bW_g
            rh = numba.carray(lanes_G(acc), (G, U))      # [G, U] R_g h + bR_g
            v = numba.carray(lanes_V(acc), (VL, U))      # [V, U] cell vectors
            saved = numba.carray(lanes_S(acc), (S, U))   # [S, U] out: saved values
            h_prev = numba.carray(lanes(acc), U)         # [U]    h (0 with a projection: never read)
            c_prev = numba.carray(lanes(acc), U)         # [U]    c (0 without a state)
            m_out = numba.carray(lanes(acc), U)          # [U]    out: m
            c_out = numba.carray(lanes(acc), U)          # [U]    out: c'
            for j0 in range(0, H, U):
                n = min(U, H - j0)
                # gather the chunk's inputs (loops over contiguous slices: vectorized)
                for g in range(G):
                    q = g * H + j0
                    load_sum(wx[g], gx[t, b, q:q + n], bW[q:q + n], n)
                    load_sum(rh[g], gh[b, q:q + n], bR[q:q + n], n)
                for k in range(V):
                    load(v[k], vec[k, j0:j0 + n], n)
                if PROJ:
                    h_prev[:] = zero
                else:
                    load(h_prev, h[b, j0:j0 + n], n)
                if STATE:
                    load(c_prev, c[b, j0:j0 + n], n)
                else:
                    c_prev[:] = zero
                # the cell, one lane per unit: reads and writes only the scratch, so LLVM vectorizes it
                for u in range(n):
                    m_out[u], c_out[u] = pointwise(wx[:, u], rh[:, u], v[:, u], h_prev[u], c_prev[u], saved[:, u])
                # scatter the results
                for k in range(S):
                    load(acts[t, b, k * H + j0:k * H + j0 + n], saved[k], n)
                if STATE:
                    load(c[b, j0:j0 + n], c_out, n)
                    load(cs[t, b, j0:j0 + n], c_out, n)
                if PROJ:
                    load(m_step[b, j0:j0 + n], m_out, n)
                    load(ms[t, b, j0:j0 + n], m_out, n)
                else:
                    load(h[b, j0:j0 + n], m_out, n)
                    load(y[t, b, d * P + j0:d * P + j0 + n], m_out, n)

    return cached_step(step, parallel, njit_function(cell.forward, compute), G, S, VL, U)


@functools.cache
def backward_step(cell, compute: str, has_proj: bool, parallel: bool):
    """The fused pointwise backward of one step, one direction (see the module docstring)."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    U = UNITS
    STATE = cell.cell_state
    PROJ = has_proj
    SPLIT = cell.split_mask                     # per gate: the R side has its own gradient
    KEY = variant_key(cell, compute, has_proj, parallel)

    def step(
        s,        # int     step index (runs T-1 .. 0)
        d,        # int     direction
        lens,     # [B]     int32
        rows,     # [n]     int64 the batch rows to run (all of them: np.arange(B); fused.py: one row group's)
        dy,       # [T, B, D*P]   gradient reaching the layer output
        y,        # [T, B, D*P]   layer output (reserve): h entering each step
        h0,       # [B, P]        initial h of this pseudo-layer
        c0,       # [B, H]        initial c
        acts,     # [T, B, S*H]   reserve: saved values
        cs,       # [T, B, H]     reserve: c'
        vec,      # [V, H]        cell vectors
        dm_proj,  # [B, P->H]     projection: W_proj^T (dy + dh) of this step, from BLAS
        dh,       # [B, P]        in: dh' from the next step; out: the part that bypasses R
        dc,       # [B, H]        in: dc'; out: dc_prev
        dgx,      # [T, B, G*H]   out: W-side pre-activation gradients (t layout)
        dgh_s,    # [B, G*H]      out: R-side pre-activation gradients of this step (0 for inactive rows)
        hp_s,     # [B, P]        out: h entering this step (for dR; 0 for inactive rows)
        dv_acc,   # [B, V, H]     cell-vector gradients, accumulated per row
    ):
        KEY  # noqa: B018  (the variant's fingerprint, see forward_step)
        P = dh.shape[1]
        H = dgx.shape[2] // G
        for i in prange(rows.shape[0]):
            b = rows[i]
            if s >= lens[b]:                    # inactive: no gradient through R, dh and dc carry
                dgh_s[b, :] = zero
                hp_s[b, :] = zero
                continue
            t = s if d == 0 else lens[b] - 1 - s
            tp = t - 1 if d == 0 else t + 1     # the time index of the previous step
            first = s == 0
            load(hp_s[b], h0[b] if first else y[tp, b, d * P:d * P + P], P)
            # scratch for one chunk of U units, lane u = unit j0+u (stack memory, see stack_buffer)
            saved = numba.carray(lanes_S(acc), (S, U))   # [S, U] the forward's saved values
            v = numba.carray(lanes_V(acc), (VL, U))      # [V, U] cell vectors
            dwx = numba.carray(lanes_G(acc), (G, U))     # [G, U] out: dL/d(wx_g)
            drh = numba.carray(lanes_G(acc), (G, U))     # [G, U] out: dL/d(rh_g) (split gates)
            dv = numba.carray(lanes_V(acc), (VL, U))     # [V, U] out: dL/d(v_k)
            dm = numba.carray(lanes(acc), U)             # [U]    dL/dm
            h_prev = numba.carray(lanes(acc), U)         # [U]    h entering the step (0 with a projection)
            c_prev = numba.carray(lanes(acc), U)         # [U]    c entering the step
            c_new = numba.carray(lanes(acc), U)          # [U]    c'
            dcell = numba.carray(lanes(acc), U)          # [U]    dL/dc'
            dh_out = numba.carray(lanes(acc), U)         # [U]    out: dL/dh bypassing R
            dc_out = numba.carray(lanes(acc), U)         # [U]    out: dL/dc
            for j0 in range(0, H, U):
                n = min(U, H - j0)
                # gather the chunk's inputs
                if PROJ:
                    load(dm, dm_proj[b, j0:j0 + n], n)
                    h_prev[:] = zero
                else:
                    load_sum(dm, dy[t, b, d * P + j0:d * P + j0 + n], dh[b, j0:j0 + n], n)
                    load(h_prev, hp_s[b, j0:j0 + n], n)
                for k in range(S):
                    load(saved[k], acts[t, b, k * H + j0:k * H + j0 + n], n)
                for k in range(V):
                    load(v[k], vec[k, j0:j0 + n], n)
                if STATE:
                    load(c_prev, c0[b, j0:j0 + n] if first else cs[tp, b, j0:j0 + n], n)
                    load(c_new, cs[t, b, j0:j0 + n], n)
                    load(dcell, dc[b, j0:j0 + n], n)
                else:
                    c_prev[:] = zero
                    c_new[:] = zero
                    dcell[:] = zero
                # the cell, one lane per unit (vectorized, as in forward_step)
                for u in range(n):
                    for g in range(G):
                        dwx[g, u] = zero
                        drh[g, u] = zero
                    for k in range(V):
                        dv[k, u] = zero
                    dh_out[u], dc_out[u] = pointwise(dm[u], dcell[u], saved[:, u], v[:, u], h_prev[u], c_prev[u],
                                                     c_new[u], dwx[:, u], drh[:, u], dv[:, u])
                # scatter the results
                for g in range(G):
                    q = g * H + j0
                    load(dgx[t, b, q:q + n], dwx[g], n)
                    load(dgh_s[b, q:q + n], drh[g] if SPLIT[g] else dwx[g], n)
                for k in range(V):
                    accumulate(dv_acc[b, k, j0:j0 + n], dv[k], n)
                if STATE:
                    load(dc[b, j0:j0 + n], dc_out, n)
                if not PROJ:
                    load(dh[b, j0:j0 + n], dh_out, n)
            if PROJ:                            # no path bypasses R with a projection
                dh[b, :] = zero

    return cached_step(step, parallel, njit_function(cell.backward, compute), G, S, VL, U)


def parallel_step(B: int, H: int) -> bool:
    """Whether a step of B rows of H units runs the parallel twin (see PARALLEL_MIN_WORK)."""
    return B * H >= PARALLEL_MIN_WORK and threads.num_threads() > 1 and B > 1


def pick(factory, cell, compute, has_proj, B, H):
    """The serial or parallel twin of a step loop for B rows of H units."""
    return factory(cell, str(compute), has_proj, parallel_step(B, H))

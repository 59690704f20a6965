"""Step kernels v1, templates over a cell (`numbarnn.cells.CellSpec`): one body per direction of work, the
cell's pointwise math compiled into it, and an exact argument list per cell.

v1 (this module): one thread per (direction d, batch row b, unit j); grid = (ceil(H / threads), B, D), so one
launch serves both directions of a layer.  At step s, row b is active iff s < len[b]; its time index is
t = s (forward) or len[b]-1-s (reverse: reversal within the sequence's length, no reversed copy of the data).

Forward step (1 launch per step; +1 `project` launch with a projection):
    wx[g] = gx[d, t, b, g*H+j] + bW[g, j]                  the input side of gate g (W x from the big GEMM)
    rh[g] = bR[g, j] + sum_k R[g*H+j, k] * h[d, b, k]      the recurrent side, fused matvec
          (a diagonal recurrence: rh[g] = bR[g, j] + u[g*H+j] * h[d, b, j], R holds the vectors u_g)
    m, c' = cell.forward(wx, rh, v, h[j], c[j], saved)     the cell's own pointwise math
    saved -> reserve ; c' -> c ; m -> h', y (or -> the projection's input)
Backward step (the pointwise half; `recurrent.py` then adds dgh @ R into dh_prev):
    dm = dy + dh_next (or W_proj^T (dy + dh_next))
    dh_direct, dc_prev = cell.backward(dm, dc, saved, v, h, c, c', dwx, drh, dv)
    dwx -> dgx ; drh (split gates) or dwx -> dgh ; dv -> dvec ; dh_direct -> dh_prev (recurrent adds R^T dgh)
The step kernels v2 and v3 multiply by a matrix R; a cell with a diagonal recurrence runs these (the driver's
step_plan says so in the launch log's note).

How a template becomes a kernel: the body is written once with every array a cell could need; a cell's
kernel is a two-line wrapper whose argument list is exactly the arrays that cell uses, calling the body with
None for the rest (numba prunes ``if x is not None`` at compile time, so an absent array costs nothing, not
even a launch parameter).  `kernel_source(...)` shows the wrapper.  The cell's pointwise functions are plain
Python: `device_function` rebinds the helpers they call (sigmoid, tanh, ...) to typed device functions.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int64

from ..cells import HELPERS, get_cell
from ..cells.functions import compile_with_twins
from .common import DTYPES, acc_dtype, activations, arr, device, nb

# ---------------------------------------------------------------------------------------------------
# the cell's pointwise functions as device functions
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def helpers(dtype) -> dict:
    """numbarnn.cells helper -> its device twin computing in acc_dtype(dtype) (typed constants: numba would
    promote ``float32 * 0.5`` to float64)."""
    f = acc_dtype(dtype).type
    zero, one = f(0.0), f(1.0)
    sigmoid, tanh, relu = activations(dtype)          # the overflow-free twins every kernel shares

    @device
    def dsigmoid(s):
        return s * (one - s)

    @device
    def dtanh(t):
        return one - t * t

    @device
    def drelu(r):
        return one if r > zero else zero

    @device
    def one_minus(x):
        return one - x

    twins = dict(sigmoid=sigmoid, tanh=tanh, relu=relu, dsigmoid=dsigmoid, dtanh=dtanh, drelu=drelu,
                 one_minus=one_minus)
    return {HELPERS[name]: twin for name, twin in twins.items()}


def device_function(fn, dtype):
    """`fn` (plain Python) as an inlined CUDA device function for `dtype`: every numbarnn.cells helper it
    calls becomes its typed twin, and every other plain Python function it calls is compiled the same way
    (`numbarnn.cells.functions.compile_with_twins`, shared with the CPU backend)."""
    return compile_with_twins(fn, helpers(str(np.dtype(dtype))), device)


# ---------------------------------------------------------------------------------------------------
# the argument lists: (name, kind, ndim, shape comment, used by (cell, has_proj))
# kind "s" = storage dtype, "a" = compute dtype (carried state), "i64"/"i32" integers
# ---------------------------------------------------------------------------------------------------
ALWAYS = (lambda cell, proj: True)
STATE = (lambda cell, proj: cell.cell_state)
PROJ = (lambda cell, proj: proj)
NO_PROJ = (lambda cell, proj: not proj)
VECTORS = (lambda cell, proj: cell.V > 0)

FORWARD_ARGS = (
    ("s", "i64", 0, "step index", ALWAYS),
    ("lens", "i32", 1, "[B] sequence lengths", ALWAYS),
    ("gx", "s", 4, "[D, T, B, G*H] W x_t for every step (no bias)", ALWAYS),
    ("unit_params", "s", 3, "[D, 2G+V, H] bW, bR and the cell vectors", ALWAYS),
    ("R_fwd", "s", 2, "[G*H, P] recurrent matrices, forward direction ([G*H] vectors u_g: diagonal)", ALWAYS),
    ("R_rev", "s", 2, "[G*H, P] ... reverse direction (= R_fwd when D == 1)", ALWAYS),
    ("h_in", "a", 3, "[D, B, P] h entering the step", ALWAYS),
    ("h_out", "a", 3, "[D, B, P] h leaving it (with a projection the project kernel writes it)", NO_PROJ),
    ("c", "a", 3, "[D, B, H] cell state, updated in place", STATE),
    ("y", "s", 3, "[T, B, D*P] layer output", NO_PROJ),
    ("acts", "s", 4, "[D, T, B, S*H] reserve: the cell's saved values", ALWAYS),
    ("cs", "s", 4, "[D, T, B, H] reserve: c'", STATE),
    ("ms", "s", 4, "[D, T, B, H] reserve: m, the projection's input", PROJ),
)

BACKWARD_ARGS = (
    ("s", "i64", 0, "step index (runs T-1 .. 0)", ALWAYS),
    ("lens", "i32", 1, "[B] sequence lengths", ALWAYS),
    ("dy", "s", 3, "[T, B, D*P] gradient reaching the layer output", ALWAYS),
    ("y", "s", 3, "[T, B, D*P] layer output (reserve): h entering each step", ALWAYS),
    ("h0", "s", 3, "[D, B, P] initial h of this layer", ALWAYS),
    ("c0", "s", 3, "[D, B, H] initial c of this layer", STATE),
    ("acts", "s", 4, "[D, T, B, S*H] reserve: the cell's saved values", ALWAYS),
    ("cs", "s", 4, "[D, T, B, H] reserve: c'", STATE),
    ("unit_params", "s", 3, "[D, 2G+V, H] bW, bR and the cell vectors", VECTORS),
    ("Wp_fwd", "s", 2, "[P, H] projection, forward direction", PROJ),
    ("Wp_rev", "s", 2, "[P, H] ... reverse direction", PROJ),
    ("dh_in", "a", 3, "[D, B, P] dh' arriving from the next step", ALWAYS),
    ("dh_out", "a", 3, "[D, B, P] out: the part of dh_prev that bypasses R (recurrent_backward adds dgh R)",
     ALWAYS),
    ("dc", "a", 3, "[D, B, H] dc' arriving from the next step, replaced by dc_prev", STATE),
    ("dgx", "s", 4, "[D, T, B, G*H] out: W-side pre-activation gradients", ALWAYS),
    ("dgh", "s", 4, "[D, T, B, G*H] out: R-side pre-activation gradients", ALWAYS),
    ("dvec", "s", 4, "[D, T, B, V*H] out: cell-vector gradient contributions", VECTORS),
    ("h_prev", "s", 4, "[D, T, B, P] out: h entering each step (for dR)", ALWAYS),
    ("dh_total", "s", 4, "[D, T, B, P] out: dy + dh_next (for dW_proj)", PROJ),
)


def used_args(table, cell, has_proj: bool) -> list[str]:
    """The names of `table` that a kernel of `cell` takes, in order (the driver passes exactly these)."""
    return [name for name, _, _, _, used in table if used(cell, has_proj)]


def arg_ndim(name: str, ndim: int, cell) -> int:
    """A table's rank of argument `name` for `cell`: R is [G*H] (the vectors u_g) for a diagonal recurrence."""
    return 1 if cell.diagonal and name in ("R_fwd", "R_rev") else ndim


def signature(table, cell, dtype, has_proj: bool) -> tuple:
    """numba argument types of the kernel (for the kernel report's compiles)."""
    a = str(acc_dtype(dtype))
    kinds = {"s": str(np.dtype(dtype)), "a": a, "i32": "int32"}
    out = []
    for name, kind, ndim, _, used in table:
        if used(cell, has_proj):
            out.append(nb("int64") if kind == "i64" else arr(kinds[kind], arg_ndim(name, ndim, cell)))
    return tuple(out)


def kernel_source(kernel_name: str, body_name: str, table, cell, has_proj: bool) -> str:
    """The wrapper: the cell's exact argument list (one per line, with its shape), calling the body."""
    used = set(used_args(table, cell, has_proj))
    lines = [f"def {kernel_name}("]
    for name, _, _, comment, _ in table:
        if name in used:
            lines.append(f"    {name + ',':<13}# {comment}")
    lines.append("):")
    call = ", ".join(name if name in used else "None" for name, *_ in table)
    lines.append(f"    {body_name}({call})")
    return "\n".join(lines) + "\n"


def _wrap(kernel_name, body, table, cell, has_proj):
    source = kernel_source(kernel_name, "body", table, cell, has_proj)
    namespace = {"body": body}
    exec(compile(source, f"<numbarnn kernel {kernel_name}>", "exec"), namespace)
    fn = namespace[kernel_name]
    fn.source = source
    return fn


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_forward_step(cell, dtype, has_proj: bool):
    """Fused recurrent matvec + the cell's pointwise forward for one step of both directions.
    cell: a CellSpec (the cache key: a cell registered again under the same name gets new kernels)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)                              # local arrays need a length >= 1
    pointwise = device_function(cell.forward, dtype)

    @device
    def matrix_recurrence(rh, R, h_in, d, b, j, H, P):
        for k in range(P):                      # the recurrent matvec, fused: R h for this unit's G rows
            hk = h_in[d, b, k]
            for g in range(G):
                rh[g] += acc(R[g * H + j, k]) * hk

    @device
    def diagonal_recurrence(rh, R, h_in, d, b, j, H, P):
        hj = h_in[d, b, j]                      # u_g ⊙ h: each unit sees only its own h (P == H)
        for g in range(G):
            rh[g] += acc(R[g * H + j]) * hj

    recurrence = diagonal_recurrence if cell.diagonal else matrix_recurrence

    @device
    def forward_body(s, lens, gx, unit_params, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = unit_params.shape[2]
        P = h_in.shape[2]
        if j >= H:
            return
        if s >= lens[b]:                        # past the length: carry the state, no output
            if h_out is not None:
                h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        wx = cuda.local.array(G, acc)          # W_g x + bW_g
        rh = cuda.local.array(G, acc)          # R_g h + bR_g
        v = cuda.local.array(VL, acc)   # cell vectors at unit j
        saved = cuda.local.array(S, acc)
        for g in range(G):
            wx[g] = acc(gx[d, t, b, g * H + j]) + acc(unit_params[d, g, j])
            rh[g] = acc(unit_params[d, G + g, j])
        for k in range(V):
            v[k] = acc(unit_params[d, 2 * G + k, j])
        recurrence(rh, R, h_in, d, b, j, H, P)
        h_unit = h_in[d, b, j] if h_out is not None else zero   # with a projection the cell never reads h
        c_prev = c[d, b, j] if c is not None else zero
        m, c_new = pointwise(wx, rh, v, h_unit, c_prev, saved)
        for k in range(S):
            acts[d, t, b, k * H + j] = saved[k]
        if c is not None:
            c[d, b, j] = c_new
            cs[d, t, b, j] = c_new
        if h_out is not None:                   # no projection: m is h'
            h_out[d, b, j] = m
            y[t, b, d * P + j] = m
        if ms is not None:                      # projection: m is the project kernel's input
            ms[d, t, b, j] = m

    name = f"{cell.name}_forward_step" + ("_proj" if has_proj else "")
    return _wrap(name, forward_body, FORWARD_ARGS, cell, has_proj)


@functools.lru_cache(maxsize=None)
def make_project(dtype):
    """h' = W_proj m for active rows (one thread per (d, b, k), k < P); carry h for the others."""
    acc = acc_dtype(dtype).type

    def project(
        s,         # int64          step index
        lens,      # [B] int32
        ms,        # [D, T, B, H]   m of this step (reserve)
        Wp_fwd,    # [P, H]         projection, forward direction
        Wp_rev,    # [P, H]         ... reverse direction
        h_in,      # [D, B, P] acc
        h_out,     # [D, B, P] acc
        y,         # [T, B, D*P]
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = h_in.shape[2]
        H = ms.shape[3]
        if k >= P:
            return
        if s >= lens[b]:
            h_out[d, b, k] = h_in[d, b, k]
            return
        t = s if d == 0 else lens[b] - 1 - s
        Wp = Wp_fwd if d == 0 else Wp_rev
        h = acc(0.0)
        for j in range(H):
            h += acc(Wp[k, j]) * acc(ms[d, t, b, j])
        h_out[d, b, k] = h
        y[t, b, d * P + k] = h

    return project


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_backward_step(cell, dtype, has_proj: bool):
    """The cell's pointwise backward for one step of both directions (one thread per (d, b, j))."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    SPLIT = cell.split_mask                     # per gate: the R side has its own gradient
    pointwise = device_function(cell.backward, dtype)

    @device
    def backward_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, Wp_fwd, Wp_rev, dh_in, dh_out, dc, dgx,
                      dgh, dvec, h_prev, dh_total):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = dgx.shape[3] // G
        P = h0.shape[2]
        if j >= H or s >= lens[b]:
            return
        step = int64(1) if d == 0 else int64(-1)
        t = s if d == 0 else lens[b] - 1 - s
        first = s == 0
        hp = zero
        if j < P:                               # this thread also records h entering the step, unit j
            hp = acc(h0[d, b, j]) if first else acc(y[t - step, b, d * P + j])
            h_prev[d, t, b, j] = hp
            if dh_total is not None:
                dh_total[d, t, b, j] = acc(dy[t, b, d * P + j]) + dh_in[d, b, j]
        if Wp_fwd is not None:                  # dm = W_proj^T (dy + dh_next), fused
            Wp = Wp_fwd if d == 0 else Wp_rev
            dm = zero
            for k in range(P):
                dm += acc(Wp[k, j]) * (acc(dy[t, b, d * P + k]) + dh_in[d, b, k])
            hp = zero                           # with a projection the cell never reads h
        else:
            dm = acc(dy[t, b, d * P + j]) + dh_in[d, b, j]
        saved = cuda.local.array(S, acc)
        for k in range(S):
            saved[k] = acc(acts[d, t, b, k * H + j])
        v = cuda.local.array(VL, acc)
        if unit_params is not None:
            for k in range(V):
                v[k] = acc(unit_params[d, 2 * G + k, j])
        c_prev = zero
        c_new = zero
        dcell = zero
        if cs is not None:
            c_prev = acc(c0[d, b, j]) if first else acc(cs[d, t - step, b, j])
            c_new = acc(cs[d, t, b, j])
            dcell = dc[d, b, j]
        dwx = cuda.local.array(G, acc)
        drh = cuda.local.array(G, acc)
        dv = cuda.local.array(VL, acc)
        dh_direct, dc_prev = pointwise(dm, dcell, saved, v, hp, c_prev, c_new, dwx, drh, dv)
        for g in range(G):
            dgx[d, t, b, g * H + j] = dwx[g]
            dgh[d, t, b, g * H + j] = drh[g] if SPLIT[g] else dwx[g]
        if dvec is not None:
            for k in range(V):
                dvec[d, t, b, k * H + j] = dv[k]
        if dc is not None:
            dc[d, b, j] = dc_prev
        if j < P:
            dh_out[d, b, j] = zero if Wp_fwd is not None else acc(dh_direct)

    name = f"{cell.name}_backward_step" + ("_proj" if has_proj else "")
    return _wrap(name, backward_body, BACKWARD_ARGS, cell, has_proj)


def proj_variants(cell) -> tuple:
    return (False, True) if cell.projection else (False,)


#: the cells the kernel report compiles: the built-in ones and the shipped user cells (numbarnn.contrib)
REPORTED_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu", "peephole_lstm", "cifg_lstm", "indrnn", "indrnn_relu",
                  "gru_v1", "mgu", "layer_norm_lstm", "layer_norm_gru")


def reported_cells(recurrence: str | None = None) -> list:
    """The specs of REPORTED_CELLS (registering the shipped user cells), only those of one `recurrence` if given
    (the v2 and v3 kernels take the "matrix" ones: a diagonal recurrence runs v1's; so do a modulated cell and a
    layer-normalised one, which a given `recurrence` leaves out)."""
    import numbarnn.contrib.cifg_lstm  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.gru_v1  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.mgu  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.indrnn  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.layer_norm_gru  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.layer_norm_lstm  # lazy: registers the shipped cells when asked  # noqa: F401
    import numbarnn.contrib.peephole_lstm  # lazy: registers the shipped cells when asked  # noqa: F401
    return [cell for cell in map(get_cell, REPORTED_CELLS)
            if recurrence is None or (recurrence == cell.recurrence and not cell.modulated and not cell.layer_norm)]


def kernel_specs():
    """The step kernels of REPORTED_CELLS (the same list in every process, whatever else was registered)."""
    specs = []
    for dt in DTYPES:
        for cell in reported_cells():
            if cell.layer_norm:                 # its step kernels are kernels/layer_norm.py's
                continue
            for proj in proj_variants(cell):
                tag = "_proj" if proj else ""
                if not cell.modulated:          # a modulated cell's forward step is kernels/modulated.py's
                    specs.append((f"{cell.name}_forward_step{tag}", dt, make_forward_step(cell, dt, proj),
                                  signature(FORWARD_ARGS, cell, dt, proj), 128))
                specs.append((f"{cell.name}_backward_step{tag}", dt, make_backward_step(cell, dt, proj),
                              signature(BACKWARD_ARGS, cell, dt, proj), 128))
        a = str(acc_dtype(dt))
        specs.append(("project", dt, make_project(dt),
                      (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3),
                       arr(dt, 3)), 128))
    return specs

r"""BlockLSTM kernels (SPEC 9), the twins of `numbarnn/reference/block_lstm.py`.

TensorFlow's ``BlockLSTM`` / ``BlockLSTMV2`` and their gradients.  ``w [I+C, 4C]`` holds the input rows
``w[:I]`` and the recurrent rows ``w[I:]``; the 4C axis holds four C-wide gate blocks, V1 'icfo' =
``[i | ci | f | o]`` and V2 'ifco' = ``[i | f | ci | o]``.  The block offsets are compile-time constants of
every factory, like the peephole and clip flags; ``forget_bias`` and the ``cell_clip`` value are run-time
scalars (a new value must not compile a new kernel).

Forward (``forward``)                                                   launches
    fill          the seven outputs are 0 at t >= seq_len_max              7 (only if seq_len_max < T)
    gemm          gx = x[:S] @ w[:I]               [S*B, 4C], all steps    1
    per step t:   block_lstm_forward_step                                  1 per step
                  one thread per (b, j): the recurrent matvec h_p @ w[I:] for the unit's 4 gate columns,
                  + b + peephole + forget_bias, the gates, clip, writes i, cs, f, o, ci, co, h at t.
                  h_p, cs_p are h[t-1], cs[t-1] (h_prev, cs_prev at t = 0): the launcher passes 2-D views.

Backward (``backward``), t = S-1 .. 0
    per step t:   block_lstm_backward_step   one thread per (b, j):        1 per step
                      dh  = h_grad[t] + dh_next ;  do = o(1-o)*dh*co
                      dcs = (1-co²)*dh*o + cs_grad[t] + dcs_next (+ do*wco)
                      dci = (1-ci²)*dcs*i ; df = f(1-f)*dcs*cs_p ; di = i(1-i)*dcs*ci
                      dgates[t] = [di, df, dci, do] placed by the layout ; dcs_next = dcs*f (+ di*wci + df*wcf)
                  block_lstm_dh_prev         one thread per (b, k):        1 per step
                      dh_next[b, k] = sum_g dgates[t, b, g] * w[I+k, g]      (= (dgates @ w[I:]ᵀ)[b, k])
    after the loop, over all S steps at once:
      gemm        x_grad[:S] = dgates @ w[:I]ᵀ ; w_grad[:I] = x[:S]ᵀ @ dgates
                  w_grad[I:] = h_prevᵀ @ dgates[0] + h[:S-1]ᵀ @ dgates[1:]  (h_p of every step, no copy)
      block_lstm_bias_grad        b_grad = column sums of dgates           (deterministic: fixed order,
      block_lstm_peephole_grads   wci/wcf/wco_grad = sums over (t, b)       one thread per output, no atomics)

The per-step dh buffer needs no double buffering: the pointwise kernel of step t has finished reading
``dh_next`` before ``block_lstm_dh_prev`` (the next launch on the stream) overwrites it, and that kernel
reads only ``dgates`` and ``w``.  ``dcs_next`` is per (b, j), updated in place by its own thread.

dtypes: float16 is stored as half and computed in float32 (``acc_dtype``): the buffers that live only
inside a call (gx, dgates, dh_next, dcs_next) are float32, and the GEMMs run on float32 copies of their
half operands (x, w, h_prev, h), their results cast back to half.  float32 / float64 compute in their own
type and need no copies.  Outputs are device arrays of the input dtype.  "gemm" is the driver's GEMM,
``gemm.DEFAULT_VERSION`` (v4), the same one the cuDNN-style ops use.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ..block_lstm_config import GATE_ORDER
from . import driver
from .common import DTYPES, acc_dtype, activations, arr, blocks, jit, nb, threads
from .driver import LaunchLog, cast_into, device_zeros, fill
from .gemm import gemm

LAYOUTS = tuple(GATE_ORDER)          # ('icfo', 'ifco')


def gate_blocks(layout: str) -> tuple:
    """(I_, CI_, F_, O_): the index 0..3 of the i, ci, f and o blocks along the 4C axis."""
    order = GATE_ORDER[layout]
    return order.index("i"), order.index("ci"), order.index("f"), order.index("o")


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_forward_step(dtype, layout: str, use_peephole: bool, use_clip: bool):
    """Fused recurrent matvec + BlockLSTM cell for one step; one thread per (b, j); grid (ceil(C/threads), B)."""
    acc = acc_dtype(dtype).type
    sigmoid, tanh, _ = activations(dtype)
    I_, CI_, F_, O_ = gate_blocks(layout)

    def block_lstm_forward_step(
        gx,            # [B, 4C] acc   x_t @ w[:I] of this step (no bias)
        cs_p,          # [B, C]        cs entering the step: cs[t-1], or cs_prev at t = 0
        h_p,           # [B, C]        h entering the step: h[t-1], or h_prev at t = 0
        w_h,           # [C, 4C]       recurrent rows of w: w[I:]
        wci,           # [C]           peephole weights (read only with use_peephole)
        wcf,           # [C]
        wco,           # [C]
        bias,          # [4C]          b
        forget_bias,   # acc scalar    added to the forget gate's pre-activation
        cell_clip,     # acc scalar    cs is clipped to [-cell_clip, cell_clip] (read only with use_clip)
        i,             # [B, C] out    i[t]
        cs,            # [B, C] out    cs[t]
        f,             # [B, C] out    f[t]
        o,             # [B, C] out    o[t]
        ci,            # [B, C] out    ci[t]
        co,            # [B, C] out    co[t]
        h,             # [B, C] out    h[t]
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        C = cs.shape[1]
        if j >= C:
            return
        # gates = [x_t, h_p] @ w + b for this unit's four columns
        a_i = acc(gx[b, I_ * C + j]) + acc(bias[I_ * C + j])
        a_ci = acc(gx[b, CI_ * C + j]) + acc(bias[CI_ * C + j])
        a_f = acc(gx[b, F_ * C + j]) + acc(bias[F_ * C + j]) + forget_bias
        a_o = acc(gx[b, O_ * C + j]) + acc(bias[O_ * C + j])
        for k in range(C):                     # the recurrent matvec, fused: h_p @ w[I:]
            hk = acc(h_p[b, k])
            a_i += hk * acc(w_h[k, I_ * C + j])
            a_ci += hk * acc(w_h[k, CI_ * C + j])
            a_f += hk * acc(w_h[k, F_ * C + j])
            a_o += hk * acc(w_h[k, O_ * C + j])
        c_p = acc(cs_p[b, j])
        if use_peephole:
            a_i += c_p * acc(wci[j])
            a_f += c_p * acc(wcf[j])
        i_t = sigmoid(a_i)
        ci_t = tanh(a_ci)
        f_t = sigmoid(a_f)
        cs_t = ci_t * i_t + f_t * c_p
        if use_clip:                           # comparisons, so that NaN propagates like np.clip
            if cs_t > cell_clip:
                cs_t = cell_clip
            elif cs_t < -cell_clip:
                cs_t = -cell_clip
        co_t = tanh(cs_t)
        if use_peephole:
            a_o += cs_t * acc(wco[j])          # the output peephole reads the NEW cs
        o_t = sigmoid(a_o)
        i[b, j] = i_t
        cs[b, j] = cs_t
        f[b, j] = f_t
        o[b, j] = o_t
        ci[b, j] = ci_t
        co[b, j] = co_t
        h[b, j] = o_t * co_t

    return block_lstm_forward_step


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_backward_step(dtype, layout: str, use_peephole: bool):
    """Pointwise BlockLSTM backward of one step (TF's gradient); one thread per (b, j)."""
    acc = acc_dtype(dtype).type
    one = acc(1.0)
    I_, CI_, F_, O_ = gate_blocks(layout)

    def block_lstm_backward_step(
        i,          # [B, C]          i[t]  (saved forward outputs at step t)
        cs,         # [B, C]          cs[t]
        f,          # [B, C]          f[t]
        o,          # [B, C]          o[t]
        ci,         # [B, C]          ci[t]
        co,         # [B, C]          co[t]
        cs_p,       # [B, C]          cs entering step t: cs[t-1], or cs_prev at t = 0
        cs_grad,    # [B, C]          cs_grad[t]
        h_grad,     # [B, C]          h_grad[t]
        wci,        # [C]             peephole weights (read only with use_peephole)
        wcf,        # [C]
        wco,        # [C]
        dh_next,    # [B, C] acc      h part of xh_grad of step t+1 (0 at the last step)
        dcs_next,   # [B, C] acc      in: dcs_next from step t+1; out: the one leaving towards t-1
        dgates,     # [B, 4C] acc out dgates[t]
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        C = cs.shape[1]
        if j >= C:
            return
        i_t = acc(i[b, j])
        f_t = acc(f[b, j])
        o_t = acc(o[b, j])
        ci_t = acc(ci[b, j])
        co_t = acc(co[b, j])
        c_p = acc(cs_p[b, j])
        dh = acc(h_grad[b, j]) + dh_next[b, j]
        do = o_t * (one - o_t) * dh * co_t
        dcs = (one - co_t * co_t) * dh * o_t + acc(cs_grad[b, j]) + dcs_next[b, j]
        if use_peephole:
            dcs += do * acc(wco[j])
        dci = (one - ci_t * ci_t) * dcs * i_t
        df = f_t * (one - f_t) * dcs * c_p
        di = i_t * (one - i_t) * dcs * ci_t
        dgates[b, I_ * C + j] = di
        dgates[b, F_ * C + j] = df
        dgates[b, CI_ * C + j] = dci
        dgates[b, O_ * C + j] = do
        dcs_p = dcs * f_t
        if use_peephole:
            dcs_p += di * acc(wci[j]) + df * acc(wcf[j])
        dcs_next[b, j] = dcs_p

    return block_lstm_backward_step


@functools.lru_cache(maxsize=None)
def make_dh_prev(dtype):
    """dh_prev = dgates @ w[I:]ᵀ (the h part of xh_grad); one thread per (b, k); grid (ceil(C/threads), B)."""
    acc = acc_dtype(dtype).type

    def block_lstm_dh_prev(
        dgates,    # [B, 4C] acc   dgates[t]
        w_h,       # [C, 4C]       recurrent rows of w: w[I:]
        dh_prev,   # [B, C] acc    out: dh_next for step t-1
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        C = dh_prev.shape[1]
        if k >= C:
            return
        total = acc(0.0)
        for g in range(4 * C):
            total += dgates[b, g] * acc(w_h[k, g])
        dh_prev[b, k] = total

    return block_lstm_dh_prev


@functools.lru_cache(maxsize=None)
def make_bias_grad(dtype):
    """b_grad[g] = sum over the S*B rows of dgates[:, g]; one thread per column, rows in a fixed order."""
    acc = acc_dtype(dtype).type

    def block_lstm_bias_grad(
        dgates,   # [S*B, 4C] acc
        b_grad,   # [4C] out
    ):
        g = cuda.grid(1)
        N, G4 = dgates.shape[0], dgates.shape[1]
        if g >= G4:
            return
        total = acc(0.0)
        for r in range(N):                     # fixed order: deterministic
            total += dgates[r, g]
        b_grad[g] = total

    return block_lstm_bias_grad


@functools.lru_cache(maxsize=None)
def make_peephole_grads(dtype, layout: str):
    """wci_grad = Σ di*cs_p, wcf_grad = Σ df*cs_p, wco_grad = Σ do*cs[t] over (t, b) in a fixed order;
    one thread per (p, j): p = 0, 1, 2 for wci, wcf, wco; grid over 3C threads."""
    acc = acc_dtype(dtype).type
    I_, CI_, F_, O_ = gate_blocks(layout)

    def block_lstm_peephole_grads(
        dgates,     # [S, B, 4C] acc
        cs_prev,    # [B, C]
        cs,         # [T, B, C]     saved cs (steps 0 .. S-1 are read)
        wci_grad,   # [C] out
        wcf_grad,   # [C] out
        wco_grad,   # [C] out
    ):
        n = cuda.grid(1)
        S, B = dgates.shape[0], dgates.shape[1]
        C = cs_prev.shape[1]
        if n >= 3 * C:
            return
        p = n // C
        j = n % C
        gate = I_ if p == 0 else (F_ if p == 1 else O_)
        total = acc(0.0)
        for t in range(S):
            for b in range(B):
                if p == 2:
                    c = acc(cs[t, b, j])                                  # wco: the step's own cs
                else:
                    c = acc(cs_prev[b, j]) if t == 0 else acc(cs[t - 1, b, j])   # wci, wcf: cs_p
                total += dgates[t, b, gate * C + j] * c
        if p == 0:
            wci_grad[j] = total
        elif p == 1:
            wcf_grad[j] = total
        else:
            wco_grad[j] = total

    return block_lstm_peephole_grads


# ---------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------

#: launches of the last forward/backward calls, kept with the RNN driver's so `numbarnn check` shows both
last_launch_count = driver.last_launch_count


def _in_dtype(a, dtype, log: LaunchLog):
    """a itself if it already has `dtype`, else a new converted copy (half GEMM operands -> float32)."""
    if np.dtype(a.dtype) == np.dtype(dtype):
        return a
    out = cuda.device_array(a.shape, dtype=dtype)
    cast_into(a, out, log)
    return out


def _step_grid(call):
    return (blocks(call.C, threads(call.C)), call.B), threads(call.C)


def forward(call, x, cs_prev, h_prev, w, wci, wcf, wco, b):
    """Device arrays in (x [T, B, I], cs_prev, h_prev [B, C], w [I+C, 4C], wci, wcf, wco [C], b [4C])
    -> device arrays (i, cs, f, o, ci, co, h), each [T, B, C] in the call's dtype, 0 at t >= seq_len_max."""
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    dt = np.dtype(call.dtype)
    a = acc_dtype(dt)
    log = LaunchLog()
    outs = [cuda.device_array((T, B, C), dtype=dt) for _ in range(7)]      # i, cs, f, o, ci, co, h
    for out in outs:
        fill(out[S:], 0.0, log)                                            # past seq_len_max: 0
    if S == 0 or B == 0 or C == 0:
        driver.record("forward", log)
        return tuple(outs)

    gx = cuda.device_array((S, B, 4 * C), dtype=a)                          # [S, B, 4C] x_t @ w[:I]
    if I == 0:
        fill(gx, 0.0, log)
    else:
        x_a = _in_dtype(x[:S], a, log)                                      # [S, B, I]
        w_a = _in_dtype(w[:I], a, log)                                      # [I, 4C]
        gemm(x_a.reshape(S * B, I), w_a, gx.reshape(S * B, 4 * C), log=log, scratch=driver.scratch)

    step = jit(make_forward_step, str(dt), call.layout, call.use_peephole, call.clip_enabled)
    grid, block = _step_grid(call)
    w_h = w[I:]                                                             # [C, 4C]
    forget_bias, cell_clip = a.type(call.forget_bias), a.type(max(call.cell_clip, 0.0))
    i, cs, f, o, ci, co, h = outs
    log.steps, before = S, log.total
    for t in range(S):
        cs_p = cs_prev if t == 0 else cs[t - 1]                             # [B, C]
        h_p = h_prev if t == 0 else h[t - 1]                                # [B, C]
        log(step, "block_lstm_forward_step", grid, block,
            gx[t], cs_p, h_p, w_h, wci, wcf, wco, b, forget_bias, cell_clip,
            i[t], cs[t], f[t], o[t], ci[t], co[t], h[t])
    log.per_step = (log.total - before) // S
    driver.record("forward", log)
    return tuple(outs)


def backward(call, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h, cs_grad, h_grad):
    """Device arrays in (the forward inputs, the saved outputs i..h and cs_grad, h_grad [T, B, C])
    -> device arrays (x_grad, cs_prev_grad, h_prev_grad, w_grad, wci_grad, wcf_grad, wco_grad, b_grad),
    shaped like x, cs_prev, h_prev, w, wci, wcf, wco, b (b itself is not needed)."""
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    dt = np.dtype(call.dtype)
    a = acc_dtype(dt)
    log = LaunchLog()
    if S == 0 or B == 0 or C == 0:                                          # no step runs: all zeros
        grads = [device_zeros(tuple(like.shape), dt, log)
                 for like in (x, cs_prev, h_prev, w, wci, wcf, wco, b)]
        driver.record("backward", log)
        return tuple(grads)
    x_grad = cuda.device_array((T, B, I), dtype=dt)                         # [T, B, I]
    fill(x_grad[S:], 0.0, log)                                             # 0 at t >= seq_len_max

    dgates = cuda.device_array((S, B, 4 * C), dtype=a)                      # [S, B, 4C] every step's dgates
    dh_next = device_zeros((B, C), a, log)                                  # [B, C] acc
    dcs_next = device_zeros((B, C), a, log)                                 # [B, C] acc
    step = jit(make_backward_step, str(dt), call.layout, call.use_peephole)
    recur = jit(make_dh_prev, str(dt))
    grid, block = _step_grid(call)
    w_h = w[I:]                                                             # [C, 4C]
    log.steps, before = S, log.total
    for t in reversed(range(S)):
        cs_p = cs_prev if t == 0 else cs[t - 1]                             # [B, C]
        log(step, "block_lstm_backward_step", grid, block,
            i[t], cs[t], f[t], o[t], ci[t], co[t], cs_p, cs_grad[t], h_grad[t], wci, wcf, wco,
            dh_next, dcs_next, dgates[t])
        log(recur, "block_lstm_dh_prev", grid, block, dgates[t], w_h, dh_next)
    log.per_step = (log.total - before) // S

    # the parts without recurrence, over all S steps at once (GEMMs in the compute dtype)
    SB = S * B
    dg2 = dgates.reshape(SB, 4 * C)                                         # [S*B, 4C]
    w_grad_a = cuda.device_array((I + C, 4 * C), dtype=a)                   # [I+C, 4C]
    if I > 0:
        w_a = _in_dtype(w[:I], a, log)                                      # [I, 4C]
        x_a = _in_dtype(x[:S], a, log)                                      # [S, B, I]
        x_grad_a = x_grad[:S] if a == dt else cuda.device_array((S, B, I), dtype=a)
        gemm(dg2, w_a, x_grad_a.reshape(SB, I), trans_b=True, log=log,      # x_grad = dgates @ w[:I]ᵀ
             scratch=driver.scratch)
        gemm(x_a.reshape(SB, I), dg2, w_grad_a[:I], trans_a=True, log=log,  # w_grad[:I] = xᵀ @ dgates
             scratch=driver.scratch)
        if a != dt:
            cast_into(x_grad_a, x_grad[:S], log)
    h_prev_a = _in_dtype(h_prev, a, log)                                    # [B, C]
    gemm(h_prev_a, dgates[0], w_grad_a[I:], trans_a=True, log=log,          # h_p of step 0 is h_prev
         scratch=driver.scratch)
    if S > 1:
        h_a = _in_dtype(h[:S - 1], a, log)                                  # [S-1, B, C] h_p of steps 1..S-1
        gemm(h_a.reshape((S - 1) * B, C), dgates[1:].reshape((S - 1) * B, 4 * C), w_grad_a[I:],
             trans_a=True, beta=1.0, log=log, scratch=driver.scratch)

    b_grad = cuda.device_array((4 * C,), dtype=dt)
    n = 4 * C
    log(jit(make_bias_grad, str(dt)), "block_lstm_bias_grad", (blocks(n, threads(n)),), threads(n),
        dg2, b_grad)
    peep = [cuda.device_array((C,), dtype=dt) for _ in range(3)]           # wci_grad, wcf_grad, wco_grad
    if call.use_peephole:
        n = 3 * C
        log(jit(make_peephole_grads, str(dt), call.layout), "block_lstm_peephole_grads",
            (blocks(n, threads(n)),), threads(n), dgates, cs_prev, cs, *peep)
    else:
        for g in peep:
            fill(g, 0.0, log)

    w_grad = _in_dtype(w_grad_a, dt, log)
    cs_prev_grad = _in_dtype(dcs_next, dt, log)
    h_prev_grad = _in_dtype(dh_next, dt, log)
    driver.record("backward", log)
    return (x_grad, cs_prev_grad, h_prev_grad, w_grad, *peep, b_grad)


# ---------------------------------------------------------------------------------------------------
# specialisations for the kernel report
# ---------------------------------------------------------------------------------------------------

def kernel_specs():
    specs = []
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        s2, s1, s3 = arr(dt, 2), arr(dt, 1), arr(dt, 3)
        a2, a3 = arr(a, 2), arr(a, 3)
        for layout in LAYOUTS:
            for peephole in (False, True):
                tag = f"_{layout}" + ("_peephole" if peephole else "")
                for clip in (False, True):
                    specs.append((f"block_lstm_forward_step{tag}" + ("_clip" if clip else ""), dt,
                                  make_forward_step(dt, layout, peephole, clip),
                                  (a2, s2, s2, s2, s1, s1, s1, s1, nb(a), nb(a),
                                   s2, s2, s2, s2, s2, s2, s2), 128))
                specs.append((f"block_lstm_backward_step{tag}", dt, make_backward_step(dt, layout, peephole),
                              (s2, s2, s2, s2, s2, s2, s2, s2, s2, s1, s1, s1, a2, a2, a2), 128))
            specs.append((f"block_lstm_peephole_grads_{layout}", dt, make_peephole_grads(dt, layout),
                          (a3, s2, s3, s1, s1, s1), 128))
        specs.append(("block_lstm_dh_prev", dt, make_dh_prev(dt), (a2, s2, a2), 128))
        specs.append(("block_lstm_bias_grad", dt, make_bias_grad(dt), (a2, s1), 128))
    return specs

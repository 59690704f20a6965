"""The v1 step kernels of a modulated cell (classic GRU, MGU: `CellSpec.modulated`), templates over the cell.

Some gates' recurrent input is R_g (m ⊙ h), m computed per unit from the other gates of the same step, so a step
makes two recurrent products with a pointwise stage between them.  One thread per (direction d, row b, unit j),
grid (ceil(H / threads), B, D), as `cell_steps.py`; rows with s >= len[b] carry their state.  Per step:

forward (2 launches)
    <cell>_modulate         rh_1[g] = bR[g, j] + sum_k R[g*H+j, k] h[d, b, k]     the unmodulated gates' matvec
                            m = cell.modulation(wx, rh_1, v, h[j]) ; q[d, b, j] = m * h[j] ; m -> mods (reserve)
                            rh_1 -> gh [D, B, G*H]
    <cell>_modulated_step   rh_2[g] = bR[g, j] + sum_k R[g*H+j, k] q[d, b, k]     the modulated gates' matvec
                            then the cell's forward, as `cell_steps.make_forward_step` (h', y, saved values)
backward (3 launches: `cell_steps.make_backward_step`, then)
    <cell>_modulate_backward dq = sum_{g modulated, k} dgh[d, t, b, g*H+k] R[g*H+k, j]      dL/d(m ⊙ h) at unit j
                            dgx, dgh (unmodulated gates) += cell.modulation_backward(dq * h_prev, m, ...)
                            dh_out += dq * m ; qs = m * h_prev, dgm[d, i] = dgh of modulated gate i (for dR)
    <cell>_recurrent_backward dh_out[d, b, k] += sum over the unmodulated gates g, j of dgh[g*H+j] R[g*H+j, k]
after the time loop the driver's GEMMs: dR = dgh^T h_prev (every row), then the modulated gates' rows again as
dgm_i^T qs.  The step kernels v2 and v3 make one product per step: a modulated cell runs these (the driver's
step_plan says so in the launch log's note).
"""
from __future__ import annotations

import functools

from numba import cuda

from .cell_steps import device_function, reported_cells
from .common import DTYPES, acc_dtype, arr, nb


def _masks(cell):
    """(per gate: not modulated, per gate: modulated, the modulated gates' indices)."""
    mod = cell.modulated_mask
    return tuple(not m for m in mod), mod, tuple(g for g, m in enumerate(mod) if m)


@functools.lru_cache(maxsize=None)
def make_modulate(cell, dtype):
    """The unmodulated gates' matvec and the modulation m (see the module docstring)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, V = cell.G, cell.V
    VL = max(V, 1)
    FREE, _, _ = _masks(cell)
    modulation = device_function(cell.modulation, dtype)

    def modulate(
        s,            # int64           step index
        lens,         # [B] int32       sequence lengths
        gx,           # [D, T, B, G*H]  W x_t for every step (no bias)
        unit_params,  # [D, 2G+V, H]    bW, bR and the cell vectors
        R_fwd,        # [G*H, H]        recurrent matrices, forward direction
        R_rev,        # [G*H, H]        ... reverse direction
        h_in,         # [D, B, H] acc   h entering the step
        gh,           # [D, B, G*H] acc out: R_g h + bR_g of the unmodulated gates
        q,            # [D, B, H] acc   out: m ⊙ h
        mods,         # [D, T, B, H]    out (reserve): m
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = unit_params.shape[2]
        if j >= H or s >= lens[b]:
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        wx = cuda.local.array(G, acc)            # W_g x + bW_g
        rh = cuda.local.array(G, acc)            # R_g h + bR_g (0 for the modulated gates)
        v = cuda.local.array(VL, acc)            # cell vectors at unit j
        for g in range(G):
            wx[g] = acc(gx[d, t, b, g * H + j]) + acc(unit_params[d, g, j])
            rh[g] = acc(unit_params[d, G + g, j]) if FREE[g] else zero
        for k in range(V):
            v[k] = acc(unit_params[d, 2 * G + k, j])
        for k in range(H):                       # the unmodulated gates' matvec
            hk = h_in[d, b, k]
            for g in range(G):
                if FREE[g]:
                    rh[g] += acc(R[g * H + j, k]) * hk
        for g in range(G):
            if FREE[g]:
                gh[d, b, g * H + j] = rh[g]
        hj = h_in[d, b, j]
        m = modulation(wx, rh, v, hj)
        mods[d, t, b, j] = m
        q[d, b, j] = m * hj

    return modulate


@functools.lru_cache(maxsize=None)
def make_modulated_step(cell, dtype):
    """The modulated gates' matvec by m ⊙ h and the cell's pointwise forward (see the module docstring)."""
    acc = acc_dtype(dtype).type
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    FREE, MOD, _ = _masks(cell)
    pointwise = device_function(cell.forward, dtype)

    def modulated_step(
        s,            # int64           step index
        lens,         # [B] int32
        gx,           # [D, T, B, G*H]  W x_t (no bias)
        unit_params,  # [D, 2G+V, H]    bW, bR and the cell vectors
        R_fwd,        # [G*H, H]
        R_rev,        # [G*H, H]
        h_in,         # [D, B, H] acc   h entering the step
        h_out,        # [D, B, H] acc   h leaving it
        gh,           # [D, B, G*H] acc the unmodulated gates' R_g h + bR_g (`modulate`)
        q,            # [D, B, H] acc   m ⊙ h (`modulate`)
        y,            # [T, B, D*H]     layer output
        acts,         # [D, T, B, S*H]  reserve: the cell's saved values
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = unit_params.shape[2]
        if j >= H:
            return
        if s >= lens[b]:                         # past the length: carry the state, no output
            h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        wx = cuda.local.array(G, acc)
        rh = cuda.local.array(G, acc)
        v = cuda.local.array(VL, acc)
        saved = cuda.local.array(S, acc)
        for g in range(G):
            wx[g] = acc(gx[d, t, b, g * H + j]) + acc(unit_params[d, g, j])
            rh[g] = gh[d, b, g * H + j] if FREE[g] else acc(unit_params[d, G + g, j])
        for k in range(V):
            v[k] = acc(unit_params[d, 2 * G + k, j])
        for k in range(H):                       # the modulated gates' matvec by m ⊙ h
            qk = q[d, b, k]
            for g in range(G):
                if MOD[g]:
                    rh[g] += acc(R[g * H + j, k]) * qk
        m, c_new = pointwise(wx, rh, v, h_in[d, b, j], acc(0.0), saved)
        for k in range(S):
            acts[d, t, b, k * H + j] = saved[k]
        h_out[d, b, j] = m
        y[t, b, d * H + j] = m

    return modulated_step


@functools.lru_cache(maxsize=None)
def make_modulate_backward(cell, dtype):
    """dL/d(m ⊙ h) through the modulated gates, into m and h (see the module docstring)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    FREE, _, MOD_GATES = _masks(cell)
    SPLIT = cell.split_mask
    GM = len(MOD_GATES)
    backward = device_function(cell.modulation_backward, dtype)

    def modulate_backward(
        s,            # int64           step index
        lens,         # [B] int32
        acts,         # [D, T, B, S*H]  reserve: the cell's saved values
        unit_params,  # [D, 2G+V, H]    (the cell vectors)
        R_fwd,        # [G*H, H]
        R_rev,        # [G*H, H]
        mods,         # [D, T, B, H]    reserve: m
        h_prev,       # [D, T, B, H]    h entering each step (the backward step wrote this one)
        dgx,          # [D, T, B, G*H]  in/out: W-side gradients, plus the unmodulated gates' through m
        dgh,          # [D, T, B, G*H]  in/out: R-side gradients, likewise
        dh_out,       # [D, B, H] acc   in: dh bypassing R; out: plus dq * m
        qs,           # [D, T, B, H]    out: m ⊙ h_prev (for dR of the modulated gates)
        dgm,          # [D, GM, T, B, H] out: dgh of each modulated gate, contiguous (for its dR)
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = mods.shape[3]
        if j >= H or s >= lens[b]:
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        dq = zero                                # (R_2^T dgh_2)_j: the modulated gates' rows, column j
        for i in range(GM):
            g = MOD_GATES[i]
            for k in range(H):
                dq += acc(dgh[d, t, b, g * H + k]) * acc(R[g * H + k, j])
            dgm[d, i, t, b, j] = dgh[d, t, b, g * H + j]
        m = acc(mods[d, t, b, j])
        hp = acc(h_prev[d, t, b, j])
        saved = cuda.local.array(S, acc)
        for k in range(S):
            saved[k] = acc(acts[d, t, b, k * H + j])
        v = cuda.local.array(VL, acc)
        for k in range(V):
            v[k] = acc(unit_params[d, 2 * G + k, j])
        dwx = cuda.local.array(G, acc)
        drh = cuda.local.array(G, acc)
        for g in range(G):
            dwx[g] = zero
            drh[g] = zero
        backward(dq * hp, m, saved, v, hp, dwx, drh)
        for g in range(G):
            if FREE[g]:
                dgx[d, t, b, g * H + j] = acc(dgx[d, t, b, g * H + j]) + dwx[g]
                dgh[d, t, b, g * H + j] = acc(dgh[d, t, b, g * H + j]) + (drh[g] if SPLIT[g] else dwx[g])
        dh_out[d, b, j] += dq * m
        qs[d, t, b, j] = m * hp

    return modulate_backward


@functools.lru_cache(maxsize=None)
def make_modulated_recurrent_backward(cell, dtype):
    """dh_prev += the unmodulated gates' dgh @ R (one thread per (d, b, k)); inactive rows carry dh."""
    acc = acc_dtype(dtype).type
    G = cell.G
    FREE, _, _ = _masks(cell)

    def modulated_recurrent_backward(
        s,        # int64           step index
        lens,     # [B] int32
        dgh,      # [D, T, B, G*H]  R-side pre-activation gradients
        R_fwd,    # [G*H, H]
        R_rev,    # [G*H, H]
        dh_in,    # [D, B, H] acc   dh arriving at this step
        dh_out,   # [D, B, H] acc   in: dh bypassing R (and through m ⊙ h); out: dh leaving towards step s-1
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = dh_in.shape[2]
        if k >= H:
            return
        if s >= lens[b]:
            dh_out[d, b, k] = dh_in[d, b, k]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        total = dh_out[d, b, k]
        for g in range(G):
            if FREE[g]:
                for j in range(H):
                    total += acc(dgh[d, t, b, g * H + j]) * acc(R[g * H + j, k])
        dh_out[d, b, k] = total

    return modulated_recurrent_backward


#: the launch names (the cell's name in front, as the step kernels')
KERNELS = ("modulate", "modulated_step", "modulate_backward", "recurrent_backward")


def kernel_specs():
    """The four kernels of every reported modulated cell (numbarnn.contrib: gru_v1, mgu)."""
    specs = []
    for dt in DTYPES:
        a, i64, i32 = str(acc_dtype(dt)), nb("int64"), arr("int32", 1)
        for cell in reported_cells():
            if not cell.modulated:
                continue
            R = (arr(dt, 2), arr(dt, 2))
            specs.append((f"{cell.name}_modulate", dt, make_modulate(cell, dt),
                          (i64, i32, arr(dt, 4), arr(dt, 3)) + R + (arr(a, 3), arr(a, 3), arr(a, 3), arr(dt, 4)), 128))
            specs.append((f"{cell.name}_modulated_step", dt, make_modulated_step(cell, dt),
                          (i64, i32, arr(dt, 4), arr(dt, 3)) + R + (arr(a, 3),) * 4 + (arr(dt, 3), arr(dt, 4)),
                          128))
            specs.append((f"{cell.name}_modulate_backward", dt, make_modulate_backward(cell, dt),
                          (i64, i32, arr(dt, 4), arr(dt, 3)) + R + (arr(dt, 4),) * 4 + (arr(a, 3), arr(dt, 4),
                                                                                         arr(dt, 5)), 128))
            specs.append((f"{cell.name}_recurrent_backward", dt, make_modulated_recurrent_backward(cell, dt),
                          (i64, i32, arr(dt, 4)) + R + (arr(a, 3), arr(a, 3)), 128))
    return specs

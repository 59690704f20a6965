"""The recurrent side of a modulated cell (classic GRU, MGU: `CellSpec.modulated`) on the CPU.

Some gates' recurrent input is R_g (m ⊙ h), m computed per unit from the other gates of the same step, so a step
makes two BLAS products with a pointwise loop between them (network.py's `blas_forward` and backward loop):

    forward    gh_1 = R_1 h                       BLAS, the unmodulated gates' rows R_1 of R (`product`)
               m = cell.modulation(wx, gh_1 + bR_1, v, h) ; q = m ⊙ h        (`modulate`, saves m)
               gh_2 = R_2 q                       BLAS, the modulated gates' rows; then the cell's step loop
    backward   the cell's step loop (dgx, dgh of every gate, dh bypassing R)
               dq = dgh_2 R_2                     BLAS
               dgx_1, dgh_1 += modulation_backward(dq ⊙ h_prev) ; dh += dq ⊙ m ; q -> qs   (`modulate_backward`)
               dh += dgh_1 R_1                    BLAS
    after the loop: dR_1 = dgh_1^T h_prev, dR_2 = dgh_2^T qs (qs: m ⊙ h_prev of every step)

The loops here are O(G*H*B) per step against the products' O(G*H*H*B): plain serial njit loops.  The forward
above runs with zoneout, skip input, or the setting cpu_fused False; otherwise `modulated_fused.py` runs it as one
fused time loop (the same results and reserve).
"""
from __future__ import annotations

import functools

import numpy as np

from . import cells
from .cells import njit_function

# Set per compiled loop (`cells.cached_step` rebinds it in a copy of this module's globals): the cell's
# modulation or modulation_backward.
pointwise = None


@functools.lru_cache(maxsize=256)
def gate_rows(cell, H: int, modulated: bool) -> np.ndarray:
    """The [G*H] rows of R (columns of gh) of the gates that are (modulated=True) or are not modulated (read-only:
    cached)."""
    rows = [np.arange(g * H, (g + 1) * H) for g, mask in enumerate(cell.modulated_mask) if mask == modulated]
    out = np.concatenate(rows).astype(np.int64)
    out.flags.writeable = False
    return out


def product(R_rows, srcT, ghT, rows, tmp):
    """ghT[rows] = R_rows @ srcT: straight into ghT when `rows` are one contiguous run (the gates of either kind
    side by side, as in gru_v1 and mgu: a C-contiguous row block), else through `tmp` [len(rows), B]."""
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == rows.size:
        np.matmul(R_rows, srcT, out=ghT[lo:hi])
    else:
        ghT[rows] = np.matmul(R_rows, srcT, out=tmp)


def columns(a, rows):
    """a[:, rows]: a view when `rows` are one contiguous run, else a copy."""
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    return a[:, lo:hi] if hi - lo == rows.size else a[:, rows]


@functools.cache
def modulate(cell, compute: str):
    """The loop between the two forward products of a step (see the module docstring)."""
    acc = np.dtype(compute).type
    G, V = cell.G, cell.V
    FREE = np.array([not m for m in cell.modulated_mask])   # per gate: not modulated (its rh is known)
    KEY = cells.variant_key(cell, compute, False, False) + " modulate"

    def loop(
        s,        # int          step index
        d,        # int          direction
        lens,     # [B] int32
        gx,       # [T, B, G*H]  W x_t (no bias)
        gh,       # [B, G*H]     R_1 h of this step in the unmodulated gates' columns (no bias; others not read)
        bW,       # [G*H]
        bR,       # [G*H]
        vec,      # [V, H]
        h,        # [B, H]       the state h entering the step
        q,        # [B, H]       out: m ⊙ h (0 for inactive rows)
        mods,     # [T, B, H]    out (reserve): m
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cells.cached_step)
        B, H = h.shape
        wx = np.zeros(G, acc)                     # [G] W_g x + bW_g of one unit
        rh = np.zeros(G, acc)                     # [G] R_g h + bR_g (0 for the modulated gates)
        v = np.zeros(max(V, 1), acc)              # [V]
        for b in range(B):
            if s >= lens[b]:
                for j in range(H):
                    q[b, j] = 0.0
                continue
            t = s if d == 0 else lens[b] - 1 - s
            for j in range(H):
                for g in range(G):
                    wx[g] = gx[t, b, g * H + j] + bW[g * H + j]
                    rh[g] = gh[b, g * H + j] + bR[g * H + j] if FREE[g] else 0.0
                for k in range(V):
                    v[k] = vec[k, j]
                m = pointwise(wx, rh, v, h[b, j])
                mods[t, b, j] = m
                q[b, j] = m * h[b, j]

    return cells.cached_step(loop, False, njit_function(cell.modulation, compute), 1, 1, 1, 1)


@functools.cache
def modulate_backward(cell, compute: str):
    """The loop between the two backward products of a step (see the module docstring)."""
    acc = np.dtype(compute).type
    G, S, V = cell.G, cell.S, cell.V
    FREE = np.array([not m for m in cell.modulated_mask])
    SPLIT = np.array(cell.split_mask)
    KEY = cells.variant_key(cell, compute, False, False) + " modulate_backward"

    def loop(
        s,        # int          step index
        d,        # int          direction
        lens,     # [B] int32
        dq,       # [B, H]       dgh_2 R_2: dL/d(m ⊙ h) of this step
        mods,     # [T, B, H]    reserve: m
        acts,     # [T, B, S*H]  reserve: the cell's saved values
        vec,      # [V, H]
        hp_s,     # [B, H]       h entering this step
        dh,       # [B, H]       in: dh bypassing R; out: plus dq ⊙ m
        dgx,      # [T, B, G*H]  in/out: W-side gradients, plus the unmodulated gates' through m
        dgh_s,    # [B, G*H]     in/out: R-side gradients of this step, likewise
        qs_s,     # [B, H]       out: m ⊙ h_prev (for dR_2; 0 for inactive rows)
    ):
        KEY  # noqa: B018  (the variant's fingerprint: see modulate)
        B, H = dh.shape
        dwx = np.zeros(G, acc)                    # [G] dL/d(wx_g) through m
        drh = np.zeros(G, acc)                    # [G] dL/d(rh_g) through m (split gates)
        saved = np.zeros(max(S, 1), acc)          # [S]
        v = np.zeros(max(V, 1), acc)              # [V]
        for b in range(B):
            if s >= lens[b]:
                for j in range(H):
                    qs_s[b, j] = 0.0
                continue
            t = s if d == 0 else lens[b] - 1 - s
            for j in range(H):
                m = mods[t, b, j]
                hp = hp_s[b, j]
                for k in range(S):
                    saved[k] = acts[t, b, k * H + j]
                for k in range(V):
                    v[k] = vec[k, j]
                for g in range(G):
                    dwx[g] = 0.0
                    drh[g] = 0.0
                pointwise(dq[b, j] * hp, m, saved, v, hp, dwx, drh)
                for g in range(G):
                    if FREE[g]:
                        dgx[t, b, g * H + j] += dwx[g]
                        dgh_s[b, g * H + j] += drh[g] if SPLIT[g] else dwx[g]
                dh[b, j] += dq[b, j] * m
                qs_s[b, j] = m * hp

    return cells.cached_step(loop, False, njit_function(cell.modulation_backward, compute), 1, 1, 1, 1)

"""The recurrent side of a cell with a diagonal recurrence (IndRNN): elementwise products instead of R's.

A diagonal cell's recurrent weight is a vector u_g [H] per gate (stacked: u [G*H]), so where a matrix cell
multiplies by R the step loops of `network.py` call these (P == H: a diagonal cell has no projection):

    forward       ghT[g*H+j, b] = u[g*H+j] * h[j, b]                     (`recurrent`, the BLAS loop's R @ h^T)
    backward      dh[b, j] += sum_g dgh_s[b, g*H+j] * u[g*H+j]           (`recurrent_backward`, dgh_s @ R)
    gradient      du[g*H+j] = sum_{t,b} dgh[t, b, g*H+j] * h_prev[t, b, j]   (`gradient`, dgh^T h_prev)

They are O(G*H*B) per step against the O(G*H*P*B) of a product by R, so the step loop's pointwise cell and the
input GEMM dominate (the fused micro-kernel loop of `fused.py` is for R's product and is not used).
"""
from __future__ import annotations

from .jitcache import njit_cached


@njit_cached
def recurrent(
    u,        # [G*H]   the gates' recurrent vectors
    hT,       # [H, B]  the state h, transposed (as the BLAS loop keeps it)
    ghT,      # [G*H, B] out: u ⊙ h per gate (no bias), transposed
):
    H, B = hT.shape
    G = ghT.shape[0] // H
    for g in range(G):
        for j in range(H):
            ug = u[g * H + j]
            for b in range(B):
                ghT[g * H + j, b] = ug * hT[j, b]


@njit_cached
def recurrent_backward(
    dgh_s,    # [B, G*H] R-side pre-activation gradients of one step
    u,        # [G*H]
    dh,       # [B, H]   in: the part of dh_prev that bypasses the recurrence; out: plus sum_g dgh_g ⊙ u_g
):
    B, H = dh.shape
    G = dgh_s.shape[1] // H
    for b in range(B):
        for g in range(G):
            for j in range(H):
                dh[b, j] += dgh_s[b, g * H + j] * u[g * H + j]


@njit_cached
def gradient(
    dgh,      # [N, G*H] R-side pre-activation gradients of every step and row (N = T*B)
    h_prev,   # [N, H]   h entering each step
    du,       # [G*H]    out: sum over rows of dgh_g ⊙ h_prev
):
    N, H = h_prev.shape
    G = dgh.shape[1] // H
    du[:] = 0.0
    for n in range(N):
        for g in range(G):
            for j in range(H):
                du[g * H + j] += dgh[n, g * H + j] * h_prev[n, j]

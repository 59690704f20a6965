"""The reference of a registered (user) cell: its scalar pointwise functions, run as plain Python in float64.

The built-in cells keep their hand-written NumPy oracle (lstm.py, gru.py, rnn.py); a cell registered with
`numbarnn.cells.register` has no independent oracle, so the reference runs the spec's own functions, unit by
unit, and its correctness rests on the finite-difference checks (`numbarnn.testing.check_cell`).  Slow and
simple on purpose: it is the same arithmetic as the kernels' template, without the kernels.

Adapters with the built-in cells' calling convention (network.py):
    forward(gx [n, G*H], gh [n, G*H], h_prev [n, H] or None, c_prev [n, H] or None, v [V, H] or None)
        -> (m [n, H], c' [n, H] or None, acts [n, S*H])
    backward(dm, dc, acts, h_prev, c_prev, c_new, v) -> (dgx [n, G*H], dgh [n, G*H], dh_direct, dc_prev, dv [n, V*H])
"""
from __future__ import annotations

import numpy as np


def make(cell):
    G, S, V = cell.G, cell.S, cell.V
    split = cell.split_mask

    def unit(a, r, j, H):
        """The values of unit j: a[r, g*H + j] for every g (gate-major layout)."""
        return a[r, j::H]

    def forward(gx, gh, h_prev, c_prev, v=None):
        n, H = gx.shape[0], gx.shape[1] // G
        m, c_new, acts = np.zeros((n, H)), np.zeros((n, H)), np.zeros((n, S * H))
        for r in range(n):
            for j in range(H):
                saved = np.zeros(S)
                m[r, j], c_new[r, j] = cell.forward(
                    unit(gx, r, j, H), unit(gh, r, j, H), v[:, j] if V else np.zeros(0),
                    0.0 if h_prev is None else h_prev[r, j], 0.0 if c_prev is None else c_prev[r, j], saved)
                acts[r, j::H] = saved
        return m, (c_new if cell.cell_state else None), acts

    def backward(dm, dc, acts, h_prev, c_prev, c_new, v=None):
        n, H = dm.shape[0], dm.shape[1]
        dgx, dgh, dv = np.zeros((n, G * H)), np.zeros((n, G * H)), np.zeros((n, V * H))
        dh, dc_prev = np.zeros((n, H)), np.zeros((n, H))
        for r in range(n):
            for j in range(H):
                dwx, drh, dvv = np.zeros(G), np.zeros(G), np.zeros(V)
                dh[r, j], dc_prev[r, j] = cell.backward(
                    dm[r, j], 0.0 if dc is None else dc[r, j], acts[r, j::H], v[:, j] if V else np.zeros(0),
                    0.0 if h_prev is None else h_prev[r, j], 0.0 if c_prev is None else c_prev[r, j],
                    0.0 if c_new is None else c_new[r, j], dwx, drh, dvv)
                dgx[r, j::H] = dwx
                dgh[r, j::H] = np.where(split, drh, dwx)
                dv[r, j::H] = dvv
        dh = 0.0 if h_prev is None else dh             # with a projection no path bypasses R (h is never read)
        return dgx, dgh, dh, (dc_prev if cell.cell_state else None), dv

    return forward, backward


def make_modulation(cell):
    """Adapters of a modulated cell's `modulation` / `modulation_backward` (network.py), unit by unit:
        modulation(gx [n, G*H], gh [n, G*H] (modulated gates' columns 0), h_prev [n, H], v [V, H] or None)
            -> mod [n, H]
        modulation_backward(dmod [n, H], mod [n, H], acts [n, S*H], h_prev [n, H], v)
            -> (dgx [n, G*H], dgh [n, G*H]): the gradients through m, to add to backward's (0 in modulated gates)
    """
    G, V = cell.G, cell.V
    split = cell.split_mask

    def modulation(gx, gh, h_prev, v=None):
        n, H = gx.shape[0], gx.shape[1] // G
        mod = np.zeros((n, H))
        for r in range(n):
            for j in range(H):
                mod[r, j] = cell.modulation(gx[r, j::H], gh[r, j::H], v[:, j] if V else np.zeros(0), h_prev[r, j])
        return mod

    def modulation_backward(dmod, mod, acts, h_prev, v=None):
        n, H = dmod.shape
        dgx, dgh = np.zeros((n, G * H)), np.zeros((n, G * H))
        for r in range(n):
            for j in range(H):
                dwx, drh = np.zeros(G), np.zeros(G)
                cell.modulation_backward(dmod[r, j], mod[r, j], acts[r, j::H], v[:, j] if V else np.zeros(0),
                                         h_prev[r, j], dwx, drh)
                dgx[r, j::H] = np.where(cell.modulated_mask, 0.0, dwx)
                dgh[r, j::H] = np.where(cell.modulated_mask, 0.0, np.where(split, drh, dwx))
        return dgx, dgh

    return modulation, modulation_backward


def make_output(cell):
    """Adapters of a normalised-state cell's `output` / `output_backward` (network.py), unit by unit:
        output(n [n, H], acts [n, S*H], v) -> m [n, H]                 n = LN(c') of each row
        output_backward(dm, n, acts, v) -> (dn [n, H], dgx [n, G*H], dgh [n, G*H]): the gradients through m, to
        add to backward's (called with dm = 0)
    """
    G, V = cell.G, cell.V
    split = cell.split_mask

    def output(n_state, acts, v=None):
        rows, H = n_state.shape
        m = np.zeros((rows, H))
        for r in range(rows):
            for j in range(H):
                m[r, j] = cell.output(n_state[r, j], acts[r, j::H], v[:, j] if V else np.zeros(0))
        return m

    def output_backward(dm, n_state, acts, v=None):
        rows, H = dm.shape
        dn, dgx, dgh = np.zeros((rows, H)), np.zeros((rows, G * H)), np.zeros((rows, G * H))
        for r in range(rows):
            for j in range(H):
                dwx, drh = np.zeros(G), np.zeros(G)
                dn[r, j] = cell.output_backward(dm[r, j], n_state[r, j], acts[r, j::H],
                                                v[:, j] if V else np.zeros(0), dwx, drh)
                dgx[r, j::H] = dwx
                dgh[r, j::H] = np.where(split, drh, dwx)
        return dn, dgx, dgh

    return output, output_backward

"""The reference network driver: layers, directions, ragged lengths, dropout, projection (SPEC 3, 5, 6).

Structured the way the kernels run, so that each kernel has a readable twin here:

    per layer l, per direction d (pseudo-layer p = l*D + d):
        gx = x_l @ W^T + bW                        one big matmul over all T steps  [T, B, G*H]
        for step s = 0 .. T-1:                     rows b with s < len[b] are active
            t  = s (forward) or len[b]-1-s (reverse: reversal within each sequence's length)
            gh = h @ R^T + bR                      the recurrent matmul             [B, G*H]
            m, c, acts = cell.forward(gx[t], gh, h, c)       fused pointwise update
            h = m @ W_proj^T (projection) or m ;   y[t, b, d*P:(d+1)*P] = h
    backward mirrors it: per step the pointwise backward and dh_prev = dgh @ R, then after the time loop
    dW = dgx^T x_l, dR = dgh^T h_prev, dW_proj = dh^T m, biases = column sums, dx_l = dgx @ W.

A cell with a diagonal recurrence (IndRNN) has a vector u_g [H] per gate instead of R_g:
    gh = [u_g ⊙ h + bR_g]_g                        (`_recurrent`)
    dh_prev += sum_g dgh_g ⊙ u_g ;  du_g = sum over t, b of dgh_g ⊙ h_prev     (`_recurrent_backward`, `_dR`)

A modulated cell (classic GRU, MGU: CellSpec.modulated) makes two recurrent products per step:
    gh_1 = h @ R_1^T + bR_1                        the unmodulated gates (rows R_1 of R)
    m = cell.modulation(gx[t], gh_1, h) ;  gh_2 = (m ⊙ h) @ R_2^T + bR_2      the modulated gates   (`_modulated`)
    backward: dq = dgh_2 @ R_2 ; dgx, dgh += modulation_backward(dq ⊙ h) ; dh_prev += dq ⊙ m + dgh_1 @ R_1
              dR_1 = dgh_1^T h_prev, dR_2 = dgh_2^T (m ⊙ h_prev)               (m saved per step: mod_l)

Zoneout (haste's, SPEC 6.1) acts on the state h' of every step, after the cell (and the projection):
    training:  h' = h_new where the mask zmask_l[d, t, b] is 1, else h_prev          (`_zoneout`)
    inference: h' = p*h_prev + (1-p)*h_new
    backward:  dh_tot = dy + dh' ; the cell gets mask*dh_tot, dh_prev gets (1-mask)*dh_tot besides its own terms

A layer-normalised cell (CellSpec.layer_norm, SPEC 13) normalises rows (layer_norm.py):
    gx = LN(x_l @ W^T) γ_x + bW ;  gh = LN(h @ R^T) γ_r + bR ;  n = LN(c') γ_c + β_c, m = cell.output(n)
    backward: dm -> output_backward -> dn -> dc' += LN_c'(dn) -> the cell's backward (dm = 0); dgh -> LN_rh'
              before dh_prev and dR; dgx -> LN_wx' after the time loop, before dW and dx (the raw W x and R h of
              each step kept in the reserve: wx_l, rh_l)

Everything is float64 here; `backend.py` casts at the boundary.  Rows past their length keep their state
and write 0 outputs; `len[b] == 0` rows never become active (final state = initial state).
"""
from __future__ import annotations

import numpy as np

from ..config import RNNCall
from ..dropout import dropout_scale
from ..params import unpack
from ..reserve import reserve_entries
from . import gru, layer_norm as ln, lstm, rnn, spec_cell
from .philox import dropout_keep_mask, zoneout_update_mask

#: the hand-written oracle of each built-in cell (shares no code with numbarnn.cells or the kernels)
CELLS = {"lstm": (lstm.forward, lstm.backward), "gru": (gru.forward, gru.backward),
         "rnn_tanh": (rnn.tanh_forward, rnn.tanh_backward), "rnn_relu": (rnn.relu_forward, rnn.relu_backward)}


def cell_functions(cfg):
    """(forward, backward) of the network's cell: hand-written for the built-ins, the spec's own otherwise.

    Both take the cell vectors v [V, H] (None when the cell has none) and backward returns their per-row
    gradient contributions dv [n, V*H] as a fifth value (None for the built-ins, which have no vectors).
    """
    if cfg.rnn_mode in CELLS:
        fwd, bwd = CELLS[cfg.rnn_mode]
        return (lambda gx, gh, h, c, v: fwd(gx, gh, h, c)), (lambda *a: bwd(*a[:6]) + (None,))
    return spec_cell.make(cfg.cell)


def _input_projection(lp, x_l, G):
    """gx = x_l @ W^T + bW for all steps at once; skip_input: W = identity per gate.  -> [T, B, G*H]"""
    if lp.W is None:
        return np.tile(x_l, (1, 1, G)) + lp.bW
    return x_l @ lp.W.T + lp.bW


def _steps(lens, s, d):
    """Active rows b (s < len[b]) and their time index t at step s of direction d."""
    b = np.flatnonzero(s < lens)
    t = s if d == 0 else lens[b] - 1 - s
    return b, np.broadcast_to(t, b.shape)


def _recurrent(cfg, lp, h):
    """gh = h @ R^T + bR, or u_g ⊙ h + bR_g for every gate of a diagonal recurrence.  h [n, P] -> [n, G*H]"""
    if cfg.cell.diagonal:
        return np.tile(h, (1, cfg.G)) * lp.R + lp.bR          # R [G*H]: u_g stacked; P == H
    return h @ lp.R.T + lp.bR


def _recurrent_backward(cfg, lp, dgh):
    """dL/dh through the recurrent side: dgh @ R, or sum_g dgh_g ⊙ u_g.  dgh [n, G*H] -> [n, P]"""
    if cfg.cell.diagonal:
        return (dgh * lp.R).reshape(dgh.shape[0], cfg.G, cfg.H).sum(axis=1)
    return dgh @ lp.R


def _dR(cfg, dgh, h_prev):
    """The recurrent weights' gradient from all steps: dgh^T h_prev [G*H, P], or for a diagonal recurrence
    du_g = sum over rows of dgh_g ⊙ h_prev [G*H].  dgh [n, G*H], h_prev [n, P]"""
    if cfg.cell.diagonal:
        return (dgh.reshape(-1, cfg.G, cfg.H) * h_prev[:, None, :]).sum(axis=0).reshape(-1)
    return dgh.T @ h_prev


def _gate_columns(cfg, modulated: bool) -> np.ndarray:
    """The [G*H] columns of the gates that are (modulated=True) or are not modulated."""
    H = cfg.H
    return np.concatenate([np.arange(g * H, (g + 1) * H) for g, mask in enumerate(cfg.cell.modulated_mask)
                           if mask == modulated] or [np.zeros(0, dtype=np.int64)]).astype(np.int64)


def _modulated(cfg, lp, modulation, gx_t, h):
    """gh of a modulated cell: the unmodulated gates' R_g h + bR_g, the modulation m, then the modulated gates'
    R_g (m ⊙ h) + bR_g.  gx_t [n, G*H], h [n, H] -> (gh [n, G*H], m [n, H])"""
    c1, c2 = _gate_columns(cfg, False), _gate_columns(cfg, True)
    gh = np.zeros(gx_t.shape)                                # [n, G*H]
    gh[:, c1] = h @ lp.R[c1].T + lp.bR[c1]
    mod = modulation(gx_t, gh, h, lp.V)                      # [n, H]
    gh[:, c2] = (mod * h) @ lp.R[c2].T + lp.bR[c2]
    return gh, mod


def _zoneout(call: RNNCall, update, h_new, h_prev):
    """haste's zoneout of one step's new state: h_new [n, P] where update [n, P] is True, else h_prev (training);
    the expectation p*h_prev + (1-p)*h_new at inference; h_new itself without zoneout."""
    if call.zoneout_active:
        return np.where(update, h_new, h_prev)
    if call.zoneout_expected:
        p = call.config.zoneout
        return p * h_prev + (1.0 - p) * h_new
    return h_new


def _normalised_input(cfg, lp, x_l):
    """gx = LN(x_l @ W^T) γ_x + bW of a cell normalising "wx" (skip_input: W = identity per gate).
    x_l [T, B, I_l] -> (gx [T, B, G*H], raw [T, B, G*H], stats [T, B, 2])"""
    raw = np.tile(x_l, (1, 1, cfg.G)) if lp.W is None else x_l @ lp.W.T      # [T, B, G*H]
    a_hat, stats = ln.normalise(raw)
    return a_hat * lp.norm(cfg.cell, "ln_wx_gain") + lp.bW, raw, stats


def _normalised_recurrent(cfg, lp, h):
    """gh = LN(h @ R^T) γ_r + bR of a cell normalising "rh".  h [n, H] -> (gh [n, G*H], raw [n, G*H], stats [n, 2])"""
    raw = h @ lp.R.T
    a_hat, stats = ln.normalise(raw)
    return a_hat * lp.norm(cfg.cell, "ln_rh_gain") + lp.bR, raw, stats


def _normalised_state(cfg, lp, c_new):
    """n = LN(c') γ_c + β_c of a cell normalising "c".  c_new [n, H] -> (n [n, H], stats [n, 2])"""
    a_hat, stats = ln.normalise(c_new)
    return a_hat * lp.norm(cfg.cell, "ln_c_gain") + lp.norm(cfg.cell, "ln_c_bias"), stats


def new_reserve(call: RNNCall) -> dict:
    return {e.name: np.zeros(e.shape) for e in reserve_entries(call)}


def forward(call: RNNCall, x, h0, c0, params):
    """x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] or None, params 1-D (all float64)
    -> (y [T, B, D*P], hT [L*D, B, P], cT [L*D, B, H] or None, saved: dict of reserve arrays)."""
    cfg, T, B = call.config, call.T, call.B
    P, D, G = cfg.P, cfg.D, cfg.G
    cell_forward, _ = cell_functions(cfg)
    modulation = spec_cell.make_modulation(cfg.cell)[0] if cfg.cell.modulated else None
    lens = call.lengths_array()
    layers = unpack(cfg, params)
    saved = new_reserve(call)
    hT = np.array(h0, dtype=np.float64)                     # [L*D, B, P]
    cT = np.array(c0, dtype=np.float64) if cfg.has_cell_state else None   # [L*D, B, H]
    h_unit = not cfg.has_proj                               # the cell may read its own h (not with a projection)
    norm = cfg.cell.layer_norm
    if "c" in norm:
        output = spec_cell.make_output(cfg.cell)[0]

    x_l = x                                                 # [T, B, I_l]
    for layer in range(cfg.L):
        if layer > 0 and call.dropout_active:
            keep = dropout_keep_mask(cfg.seed, cfg.seed2, layer, T, B, D * P, cfg.dropout)   # [T, B, D*P]
            saved[f"keep{layer}"][...] = keep
            x_l = x_l * keep * dropout_scale(cfg.dropout)
        y = np.zeros((T, B, D * P))                         # [T, B, D*P]
        for d in range(D):
            p = layer * D + d
            lp = layers[p]
            if "wx" in norm:
                gx, wx_raw, wx_stats = _normalised_input(cfg, lp, x_l)   # [T, B, G*H] x2, [T, B, 2]
            else:
                gx = _input_projection(lp, x_l, G)          # [T, B, G*H]
            h, c = hT[p], (cT[p] if cT is not None else None)   # views: updated in place, end as final state
            update = zoneout_update_mask(cfg.seed, cfg.seed2, p, T, B, P, cfg.zoneout) \
                if call.zoneout_active else None            # [T, B, P] True: h takes h_new
            for s in range(T):
                b, t = _steps(lens, s, d)
                if b.size == 0:
                    break
                if modulation is not None:                  # two products, m ⊙ h between them
                    gh, mod = _modulated(cfg, lp, modulation, gx[t, b], h[b])
                    saved[f"mod{layer}"][d, t, b] = mod
                elif "rh" in norm:
                    gh, raw, stats = _normalised_recurrent(cfg, lp, h[b])    # [n, G*H]
                    saved[f"rh{layer}"][d, t, b] = raw
                    saved[f"lnstat{layer}"][d, t, b, ln.stat_columns(cfg.cell, "rh")] = stats
                else:
                    gh = _recurrent(cfg, lp, h[b])          # [n, G*H]
                if "wx" in norm:
                    saved[f"wx{layer}"][d, t, b] = wx_raw[t, b]
                    saved[f"lnstat{layer}"][d, t, b, ln.stat_columns(cfg.cell, "wx")] = wx_stats[t, b]
                m, c_new, acts = cell_forward(gx[t, b], gh, h[b] if h_unit else None, c[b] if c is not None else None,
                                              lp.V)
                if "c" in norm:                             # m from the normalised state
                    n_state, stats = _normalised_state(cfg, lp, c_new)
                    saved[f"lnstat{layer}"][d, t, b, ln.stat_columns(cfg.cell, "c")] = stats
                    m = output(n_state, acts, lp.V)
                h_new = m @ lp.W_proj.T if lp.W_proj is not None else m   # [n, P]
                saved[f"acts{layer}"][d, t, b] = acts
                if c is not None:
                    saved[f"c{layer}"][d, t, b] = c_new
                    c[b] = c_new
                if lp.W_proj is not None:
                    saved[f"m{layer}"][d, t, b] = m
                if update is not None:
                    saved[f"zmask{layer}"][d, t, b] = update[t, b]
                h_new = _zoneout(call, update[t, b] if update is not None else None, h_new, h[b])
                y[t, b, d * P:(d + 1) * P] = h_new
                h[b] = h_new
        saved[f"y{layer}"][...] = y
        x_l = y
    return x_l, hT, cT, saved


def backward(call: RNNCall, x, h0, c0, params, dy, dhT, dcT, saved):
    """Hand-written backprop through the whole network from the saved activations.

    dy [T, B, D*P] (ignored at padded positions), dhT [L*D, B, P], dcT [L*D, B, H] or None
    -> (dx [T, B, I], dh0 [L*D, B, P], dc0 [L*D, B, H] or None, dparams 1-D), all float64.
    """
    cfg, T, B = call.config, call.T, call.B
    H, P, D, G = cfg.H, cfg.P, cfg.D, cfg.G
    _, cell_backward = cell_functions(cfg)
    modulated = bool(cfg.cell.modulated)
    if modulated:
        modulation_backward = spec_cell.make_modulation(cfg.cell)[1]
        c1, c2 = _gate_columns(cfg, False), _gate_columns(cfg, True)
    norm = cfg.cell.layer_norm
    if "c" in norm:
        output_backward = spec_cell.make_output(cfg.cell)[1]
    lens = call.lengths_array()
    dparams = np.zeros(params.shape[0])
    layers, dlayers = unpack(cfg, params), unpack(cfg, dparams)
    dh0 = np.array(dhT, dtype=np.float64)                    # [L*D, B, P], becomes input_h_backprop in place
    dc0 = np.array(dcT, dtype=np.float64) if cfg.has_cell_state else None
    valid = np.arange(T)[:, None] < lens[None, :]           # [T, B]
    dy_l = np.where(valid[:, :, None], dy, 0.0)             # [T, B, D*P] padded positions ignored
    scale = dropout_scale(cfg.dropout)

    for layer in reversed(range(cfg.L)):
        if layer == 0:
            x_l = x                                         # [T, B, I]
        else:
            x_l = saved[f"y{layer - 1}"]
            if call.dropout_active:
                x_l = x_l * saved[f"keep{layer}"] * scale
        y = saved[f"y{layer}"]                              # [T, B, D*P]
        dx_l = np.zeros(x_l.shape)                          # [T, B, I_l]
        for d in range(D):
            p = layer * D + d
            lp, dlp = layers[p], dlayers[p]
            step = 1 if d == 0 else -1                      # t of the previous step is t - step
            acts = saved[f"acts{layer}"][d]                   # [T, B, S*H]
            cs = saved[f"c{layer}"][d] if cfg.has_cell_state else None   # [T, B, H]
            dgx = np.zeros((T, B, G * H))                   # [T, B, G*H] W-side pre-activation grads
            dgh = np.zeros((T, B, G * H))                   # [T, B, G*H] R-side pre-activation grads
            h_prev_all = np.zeros((T, B, P))                # [T, B, P]   h entering each step
            dh_all = np.zeros((T, B, P))                    # [T, B, P]   total dh' at each step (projection)
            dv_all = np.zeros((T, B, cfg.V * H))            # [T, B, V*H] cell-vector gradient contributions
            q_all = np.zeros((T, B, H))                     # [T, B, H]   m ⊙ h_prev (modulated cells)
            dbR_all = np.zeros((T, B, G * H))               # [T, B, G*H] "rh" normalised: dL/d(gh), bR's gradient
            stat = saved[f"lnstat{layer}"][d] if norm else None   # [T, B, 2K]
            dh, dc = dh0[p], (dc0[p] if dc0 is not None else None)
            for s in reversed(range(T)):
                b, t = _steps(lens, s, d)
                if b.size == 0:
                    continue
                first = s == 0
                h_prev = h0[p][b] if first else y[t - step, b, d * P:(d + 1) * P]
                c_prev = None
                if cs is not None:
                    c_prev = c0[p][b] if first else cs[t - step, b]
                dh_tot = dy_l[t, b, d * P:(d + 1) * P] + dh[b]    # [n, P]
                carry = 0.0                                 # zoneout: the part of dh' that h_prev took
                if call.zoneout_active:
                    update = saved[f"zmask{layer}"][d][t, b] != 0     # [n, P]
                    carry = np.where(update, 0.0, dh_tot)
                    dh_tot = np.where(update, dh_tot, 0.0)
                dm = dh_tot @ lp.W_proj if lp.W_proj is not None else dh_tot   # [n, H]
                dc_b = dc[b] if dc is not None else None
                if "c" in norm:                             # through m = output(n), n = LN(c') γ_c + β_c
                    st = stat[t, b, ln.stat_columns(cfg.cell, "c")]                # [n, 2]
                    c_hat = ln.normalised(cs[t, b], st)                            # [n, H]
                    n_state = c_hat * lp.norm(cfg.cell, "ln_c_gain") + lp.norm(cfg.cell, "ln_c_bias")
                    dn, gx_o, gh_o = output_backward(dm, n_state, acts[t, b], lp.V)
                    dlp.norm(cfg.cell, "ln_c_gain")[...] += (dn * c_hat).sum(axis=0)
                    dlp.norm(cfg.cell, "ln_c_bias")[...] += dn.sum(axis=0)
                    dc_b = dc_b + ln.backward(dn, c_hat, st, lp.norm(cfg.cell, "ln_c_gain"))
                    dm = np.zeros_like(dm)
                gx_b, gh_b, dh_direct, dc_prev, dv = cell_backward(
                    dm, dc_b, acts[t, b], h_prev if lp.W_proj is None else None,
                    c_prev, cs[t, b] if cs is not None else None, lp.V)
                if "c" in norm:
                    gx_b, gh_b = gx_b + gx_o, gh_b + gh_o
                if "rh" in norm:                            # gh = LN(R h) γ_r + bR: back to the raw R h
                    st = stat[t, b, ln.stat_columns(cfg.cell, "rh")]
                    rh_hat = ln.normalised(saved[f"rh{layer}"][d, t, b], st)        # [n, G*H]
                    dlp.norm(cfg.cell, "ln_rh_gain")[...] += (gh_b * rh_hat).sum(axis=0)
                    dbR_all[t, b] = gh_b
                    gh_b = ln.backward(gh_b, rh_hat, st, lp.norm(cfg.cell, "ln_rh_gain"))
                if dv is not None:
                    dv_all[t, b] = dv
                if modulated:                               # through R_2 (m ⊙ h): dq, then into m and h
                    mod = saved[f"mod{layer}"][d][t, b]     # [n, H]
                    dq = gh_b[:, c2] @ lp.R[c2]             # [n, H]
                    dgx_m, dgh_m = modulation_backward(dq * h_prev, mod, acts[t, b], h_prev, lp.V)
                    gx_b, gh_b = gx_b + dgx_m, gh_b + dgh_m
                    dh_direct = dh_direct + dq * mod
                    q_all[t, b] = mod * h_prev
                    dh_rec = gh_b[:, c1] @ lp.R[c1]         # the unmodulated gates' product by h
                else:
                    dh_rec = _recurrent_backward(cfg, lp, gh_b)
                dgx[t, b], dgh[t, b], h_prev_all[t, b], dh_all[t, b] = gx_b, gh_b, h_prev, dh_tot
                dh[b] = dh_direct + dh_rec + carry
                if dc is not None:
                    dc[b] = dc_prev
            # weight gradients as big matmuls after the time loop
            gx2, gh2 = dgx.reshape(-1, G * H), dgh.reshape(-1, G * H)
            dlp.bW[...] = gx2.sum(axis=0)
            if "wx" in norm:                                # gx = LN(W x) γ_x + bW: back to the raw W x
                raw = saved[f"wx{layer}"][d]                                        # [T, B, G*H] (0 where padded)
                st = stat[:, :, ln.stat_columns(cfg.cell, "wx")]                    # [T, B, 2] (0 where padded)
                wx_hat = ln.normalised(raw, st)
                dlp.norm(cfg.cell, "ln_wx_gain")[...] = (dgx * wx_hat).reshape(-1, G * H).sum(axis=0)
                dgx = ln.backward(dgx, wx_hat, st, lp.norm(cfg.cell, "ln_wx_gain"))
                gx2 = dgx.reshape(-1, G * H)
            if lp.W is not None:
                dlp.W[...] = gx2.T @ x_l.reshape(-1, x_l.shape[-1])
                dx_l += dgx @ lp.W
            else:
                dx_l += dgx.reshape(T, B, G, H).sum(axis=2)
            if modulated:                                   # dR_1 = dgh_1^T h_prev, dR_2 = dgh_2^T (m ⊙ h_prev)
                dlp.R[c1] = gh2[:, c1].T @ h_prev_all.reshape(-1, P)
                dlp.R[c2] = gh2[:, c2].T @ q_all.reshape(-1, H)
            else:
                dlp.R[...] = _dR(cfg, gh2, h_prev_all.reshape(-1, P))
            dlp.bR[...] = (dbR_all if "rh" in norm else dgh).reshape(-1, G * H).sum(axis=0)
            if lp.W_proj is not None:
                dlp.W_proj[...] = dh_all.reshape(-1, P).T @ saved[f"m{layer}"][d].reshape(-1, H)
            if lp.V is not None:
                dlp.V[...] = dv_all.reshape(-1, cfg.V, H).sum(axis=0)
        if layer == 0:
            dx = dx_l
        else:
            dy_l = dx_l * saved[f"keep{layer}"] * scale if call.dropout_active else dx_l
    return dx, dh0, dc0, dparams

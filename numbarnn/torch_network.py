"""The RNN network as torch operations, built from the cell's own `CellSpec`: numbarnn.torch's differentiable path.

numbarnn's kernels compute the forward and the first-order backward; their backward is not itself
differentiable.  When a caller differentiates a gradient (``create_graph=True``: gradient penalties,
Hessian-vector products, MAML, ``gradgradcheck``), numbarnn.torch recomputes the forward here, with torch
operations that autograd can differentiate to any order, and lets autograd supply the derivatives.  (It also
gives the states after every step, `forward(..., state_sequence=True)`, which the kernels do not return:
numbarnn.torch.LayerNormLSTM's return_state_sequence.)

The cell is the spec's own scalar ``forward(wx, rh, v, h, c, saved)``, run once per step on whole tensors: gate g's
``wx[g]``/``rh[g]`` are the [B, H] columns of that gate, ``v[k]`` a cell vector [H], ``h``/``c`` the [B, H] states,
and every helper of ``numbarnn.cells.functions`` it calls (sigmoid, tanh, relu, ...) is rebound to its torch twin,
exactly as the kernels rebind them to typed device functions.  So user cells get second derivatives too, as
long as their forward is written with those helpers and arithmetic (no Python ``if`` on a value, no ``math``).

The network around the cell follows SPEC 3, 5 and 6 as the reference does (numbarnn/reference/network.py):
per layer and direction ``gx = x W^T + bW`` over all steps, then per step ``gh = h R^T + bR``, the cell, the
projection; rows past their length keep their state and output 0 (reversal within each sequence's length);
dropout on the inputs of layers 1.. with the Philox keep flags of SPEC 6 and the scale 1/(1-p).  A modulated cell
(``CellSpec.modulated``) makes its two products per step: the unmodulated gates' ``R_g h``, its ``modulation`` (rebound
like ``forward``), then the modulated gates' ``R_g (m ⊙ h)``.  A layer-normalised cell (``CellSpec.layer_norm``, SPEC
13) normalises as the reference does (numbarnn/reference/layer_norm.py): ``gx = LN(x W^T) γ_x + bW`` over all steps,
``gh = LN(h R^T) γ_r + bR`` per step, and with "c" ``n = LN(c') γ_c + β_c`` and ``m = output(n, saved, v)`` (the
spec's ``output``, rebound like ``forward``); LN is written out (mean, biased variance, ε = 1e-5) so that every
order of derivative is autograd's.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .cells import get_cell
from .cells.functions import HELPERS, compile_with_twins
from .dropout import dropout_scale
from .reference.layer_norm import EPS
from .reference.philox import dropout_keep_mask, zoneout_update_mask

#: the torch twin of each helper a cell's forward may call (derivatives: autograd's)
TORCH_TWINS = {HELPERS["sigmoid"]: torch.sigmoid, HELPERS["tanh"]: torch.tanh, HELPERS["relu"]: torch.relu,
               HELPERS["one_minus"]: lambda x: 1.0 - x}


@functools.lru_cache(maxsize=None)
def torch_cell_forward(cell_name: str):
    """The spec's forward with its helpers rebound to torch (a plain Python function over tensors)."""
    return compile_with_twins(get_cell(cell_name).forward, TORCH_TWINS, lambda fn: fn)


@functools.lru_cache(maxsize=None)
def torch_cell_modulation(cell_name: str):
    """A modulated cell's `modulation` with its helpers rebound to torch."""
    return compile_with_twins(get_cell(cell_name).modulation, TORCH_TWINS, lambda fn: fn)


@functools.lru_cache(maxsize=None)
def torch_cell_output(cell_name: str):
    """A normalised-state cell's `output` (m from n = LN(c')) with its helpers rebound to torch."""
    return compile_with_twins(get_cell(cell_name).output, TORCH_TWINS, lambda fn: fn)


def layer_norm(a, gain, bias=None):
    """LN across the last axis (SPEC 13): (a - mean) / sqrt(var + 1e-5) * gain (+ bias), biased var.
    a [..., N], gain [N], bias [N] or None -> [..., N]."""
    mean = a.mean(dim=-1, keepdim=True)                                # [..., 1]
    centred = a - mean                                                 # [..., N]
    rstd = torch.rsqrt((centred * centred).mean(dim=-1, keepdim=True) + EPS)   # [..., 1]
    out = centred * rstd * gain
    return out if bias is None else out + bias


def layer_tensors(cfg, slots, weights, dtype) -> list:
    """Per pseudo-layer the dict of tensors `forward` takes, from numbarnn.torch's weights in its layout order
    (slots: the layout's (pseudo-layer p, LayerParams field / ("V", k) / ("N", rows)) of each weight), cast to
    `dtype`; a normalisation group ("N") under its `CellSpec.norm_groups` name, flat (γ_x [G*H], γ_c [H], ...)."""
    layers = [dict(W=None, R=None, bW=None, bR=None, W_proj=None, V=[None] * cfg.V, N={})
              for _ in range(cfg.L * cfg.D)]
    starts, at = {}, 0                                                 # first row of each normalisation group
    for name, count in cfg.cell.norm_groups:
        starts[at], at = name, at + count
    for (p, slot), w in zip(slots, weights):
        if isinstance(slot, str):
            layers[p][slot] = w.to(dtype)
        elif slot[0] == "N":
            layers[p]["N"][starts[slot[1].start]] = w.to(dtype)
        else:
            layers[p]["V"][slot[1]] = w.to(dtype)
    return layers


def _modulated_gh(cell, modulation, lp, gx_t, h, H):
    """gh [B, G*H] of a modulated cell (bR included): the unmodulated gates' R_g h + bR_g, the modulation m from
    them, then the modulated gates' R_g (m ⊙ h) + bR_g.  gx_t [B, G*H] (bW included), h [B, H]."""
    R, bR = lp["R"], lp["bR"]
    wx = [gx_t[:, g * H:(g + 1) * H] for g in range(cell.G)]           # G x [B, H]

    def product(g, state):                                             # [B, H]
        out = state @ R[g * H:(g + 1) * H].T
        return out + bR[g * H:(g + 1) * H] if bR is not None else out

    rh = [torch.zeros_like(h) if mod else product(g, h) for g, mod in enumerate(cell.modulated_mask)]
    q = modulation(wx, rh, lp["V"], h) * h                             # [B, H] m ⊙ h
    rh = [product(g, q) if mod else rh[g] for g, mod in enumerate(cell.modulated_mask)]
    return torch.cat(rh, dim=1)


def cell_step(cell_name: str, gx, gh, v, h, c, H: int):
    """One step of a registered cell on torch tensors: gx, gh [B, G*H], v: list of [H], h, c [B, H] (c None
    without a cell state) -> (m [B, H], c' [B, H] or None)."""
    return _cell_step(get_cell(cell_name), torch_cell_forward(cell_name), gx, gh, v, h, c, H)


def _cell_step(cell, forward, gx, gh, v, h, c, H, state_norm=None):
    """One step of the cell on all rows: gx, gh [B, G*H] -> (m [B, H], c' [B, H] or None).  state_norm: a
    normalised-state cell's (output, γ_c [H], β_c [H]): m = output(LN(c') γ_c + β_c, saved, v)."""
    wx = [gx[:, g * H:(g + 1) * H] for g in range(cell.G)]           # G x [B, H]
    rh = [gh[:, g * H:(g + 1) * H] for g in range(cell.G)]
    saved = [None] * cell.S
    try:
        m, c_new = forward(wx, rh, v, 0.0 if h is None else h, 0.0 if c is None else c, saved)
    except TypeError as exc:
        raise TypeError(f"cell {cell.name!r}: its forward could not run on torch tensors ({exc}); the "
                        f"differentiable path (double backward) needs a forward written with the helpers of "
                        f"numbarnn.cells.functions (sigmoid, tanh, relu, one_minus) and arithmetic") from None
    if not isinstance(m, torch.Tensor):
        m = torch.zeros_like(gx[:, :H]) + m
    if cell.cell_state and not isinstance(c_new, torch.Tensor):
        c_new = torch.zeros_like(gx[:, :H]) + c_new
    if state_norm is not None:                                       # m from the normalised state
        output, gain, bias = state_norm
        m = output(layer_norm(c_new, gain, bias), saved, v)          # [B, H]
    return m, (c_new if cell.cell_state else None)


def forward(cfg, layers, x, h0, c0, lengths=None, dropout_keys=None, zoneout_keys=None, state_sequence=False):
    """The network forward in torch operations (differentiable to any order).

    cfg: the RNNConfig; layers: per pseudo-layer dict of tensors W [G*H, I_l], R [G*H, P] (a diagonal
    recurrence: [G*H], the vectors u_g stacked), bW, bR [G*H] (None:
    zeros), W_proj [P, H] or None, V: list of [H] cell vectors, N: a layer-normalised cell's normalisation groups
    by name (`layer_tensors`); x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] or
    None; lengths: B ints or None (all T); dropout_keys: (seed, seed2) when dropout is active, else None;
    zoneout_keys: (seed, seed2) of zoneout's training masks (SPEC 6.1), None: its expectation (cfg.zoneout > 0).
    -> (y [T, B, D*P], hT [L*D, B, P], cT [L*D, B, H] or None); with state_sequence also the states after every
    step, (hs [L*D, T, B, P], cs [L*D, T, B, H] or None), indexed by step s (the reverse direction's step s is
    time len[b]-1-s): a row past its length keeps its state, so hs[p, T-1] = hT[p]."""
    cell = get_cell(cfg.rnn_mode)
    cell_forward = torch_cell_forward(cfg.rnn_mode)
    norm = cell.layer_norm
    T, B = x.shape[0], x.shape[1]
    H, P, D = cfg.H, cfg.P, cfg.D
    lens = torch.as_tensor(np.full(B, T) if lengths is None else np.asarray(lengths), device=x.device)   # [B]
    steps = torch.arange(T, device=x.device)
    valid = steps[:, None] < lens[None, :]                                # [T, B] (t or s) < len[b]
    rev = (lens[None, :] - 1 - steps[:, None]).clamp(0, max(T - 1, 0))   # [T, B] reversed index within length
    rows = torch.arange(B, device=x.device)
    h_final, c_final = [], []
    h_steps, c_steps = [], []                                             # per pseudo-layer: [T, B, P], [T, B, H]
    x_l = x                                                               # [T, B, I_l]
    for layer in range(cfg.L):
        if layer > 0 and dropout_keys is not None:
            keep = dropout_keep_mask(dropout_keys[0], dropout_keys[1], layer, T, B, D * P, cfg.dropout)
            x_l = x_l * torch.as_tensor(keep, dtype=x_l.dtype, device=x.device) * dropout_scale(cfg.dropout)
        outs = []
        for d in range(D):
            p = layer * D + d
            lp = layers[p]
            gx = x_l @ lp["W"].T                                          # [T, B, G*H]
            if "wx" in norm:                                              # LN(W x) γ_x, then bW
                gx = layer_norm(gx, lp["N"]["ln_wx_gain"])
            if lp["bW"] is not None:
                gx = gx + lp["bW"]
            h = h0[p]                                                     # [B, P]
            c = c0[p] if cell.cell_state else None                        # [B, H]
            update = None                                                 # [T, B, P] zoneout: h takes h_new
            if cfg.zoneout and zoneout_keys is not None:
                update = torch.as_tensor(zoneout_update_mask(zoneout_keys[0], zoneout_keys[1], p, T, B, P,
                                                             cfg.zoneout), device=x.device)
            state_norm = (torch_cell_output(cfg.rnn_mode), lp["N"]["ln_c_gain"], lp["N"]["ln_c_bias"]) \
                if "c" in norm else None                                  # m = output(LN(c') γ_c + β_c)
            per_step, hs, cs = [], [], []                                 # y, h, c of step s, [B, P] / [B, H]
            for s in range(T):
                t = torch.full_like(rows, s) if d == 0 else rev[s]        # [B] time index of each row
                if cell.modulated:                                        # two products, m ⊙ h between
                    gh = _modulated_gh(cell, torch_cell_modulation(cfg.rnn_mode), lp, gx[t, rows], h, H)
                else:
                    if cell.diagonal:                                     # u_g ⊙ h per gate, R [G*H]
                        gh = h.repeat(1, cell.G) * lp["R"]                # [B, G*H]
                    else:
                        gh = h @ lp["R"].T                                # [B, G*H]
                    if "rh" in norm:                                      # LN(R h) γ_r, then bR
                        gh = layer_norm(gh, lp["N"]["ln_rh_gain"])
                    if lp["bR"] is not None:
                        gh = gh + lp["bR"]
                m, c_new = _cell_step(cell, cell_forward, gx[t, rows], gh, lp["V"],
                                      None if cfg.has_proj else h, c, H, state_norm)
                h_new = m @ lp["W_proj"].T if lp["W_proj"] is not None else m   # [B, P]
                if update is not None:                                    # haste's zoneout (SPEC 6.1)
                    h_new = torch.where(update[t, rows], h_new, h)
                elif cfg.zoneout:
                    h_new = cfg.zoneout * h + (1.0 - cfg.zoneout) * h_new
                active = valid[s][:, None]                                # [B, 1]
                h = torch.where(active, h_new, h)
                if c is not None:
                    c = torch.where(active, c_new, c)
                per_step.append(torch.where(active, h_new, torch.zeros_like(h_new)))
                if state_sequence:
                    hs.append(h)
                    cs.append(c)
            if T:
                by_step = torch.stack(per_step)                           # [T(steps), B, P]
                if d == 0:
                    y_d = by_step
                else:                                                     # y[t, b] = step len[b]-1-t
                    index = rev[:, :, None].expand(T, B, P)
                    y_d = torch.where(valid[:, :, None], torch.gather(by_step, 0, index), torch.zeros_like(by_step))
            else:
                y_d = x_l.new_zeros((0, B, P))
            outs.append(y_d)
            h_final.append(h)
            c_final.append(c)
            if state_sequence:
                h_steps.append(torch.stack(hs) if T else h.new_zeros((0, B, P)))
                c_steps.append(None if c is None else torch.stack(cs) if T else c.new_zeros((0, B, H)))
        x_l = torch.cat(outs, dim=2)                                      # [T, B, D*P]
    hT = torch.stack(h_final)                                             # [L*D, B, P]
    cT = torch.stack(c_final) if cell.cell_state else None                # [L*D, B, H]
    if state_sequence:
        hs = torch.stack(h_steps)                                         # [L*D, T, B, P]
        cs = torch.stack(c_steps) if cell.cell_state else None            # [L*D, T, B, H]
        return x_l, hT, cT, hs, cs
    return x_l, hT, cT

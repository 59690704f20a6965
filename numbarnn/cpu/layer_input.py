"""A layer's input, as every network driver of the cpu backend reads it: W x of all steps at once
(`input_projection`, one BLAS product), dropout's masks drawn and applied in the forward (`dropped_input`, SPEC 6)
and read back from the reserve in the backward (`backward_input`)."""
from __future__ import annotations

import numpy as np

from ..dropout import dropout_scale
from .philox import dropout_keep_mask


def input_projection(lp, x_l, G, out):
    """out [T, B, G*H] = x_l @ W^T (no bias: the step loop adds it); skip_input: x_l repeated per gate."""
    T, B, I_l = x_l.shape
    if lp.W is None:
        out.reshape(T, B, G, I_l)[...] = x_l[:, :, None, :]
    else:
        np.matmul(x_l.reshape(T * B, I_l), lp.W.T, out=out.reshape(T * B, out.shape[2]))
    return out


def dropped_input(call, saved: dict, layer: int, x_l, ct):
    """The input of layer `layer` (>= 1) of a call with active dropout (SPEC 6): its keep flags drawn and recorded
    in the reserve (saved["keep<layer>"]) -> x_l * keep / (1 - p) (x_l: the layer below's output [T, B, D*P])."""
    cfg = call.config
    keep = dropout_keep_mask(cfg.seed, cfg.seed2, layer, call.T, call.B, cfg.D * cfg.P, cfg.dropout)   # [T, B, D*P]
    saved[f"keep{layer}"][...] = keep
    return x_l * (keep.astype(ct) * ct.type(dropout_scale(cfg.dropout)))


def backward_input(call, saved: dict, x, layer: int, ct) -> tuple:
    """What the backward of layer `layer` reads of its input, from the reserve: (x_l, the layer's input as the
    forward saw it [T, B, I_l]; keep / (1 - p) [T, B, D*P], the factor its dx takes on the way down, or None
    where no dropout was applied)."""
    if layer == 0:
        return x, None
    x_l = saved[f"y{layer - 1}"]
    if not call.dropout_active:
        return x_l, None
    keep_scaled = saved[f"keep{layer}"] * ct.type(dropout_scale(call.config.dropout))
    return x_l * keep_scaled, keep_scaled

"""Layer normalisation across a row (SPEC 13), hand-written for the reference network.

A row is one batch row at one step: its G*H products W x or R h (every gate together), or its H cell-state
values.  Forward ``y = â * γ (+ β)`` with ``â = (a - mean) * rstd``, ``rstd = 1/sqrt(var + 1e-5)`` (biased var);
backward ``da = rstd * (g - mean(g) - â * mean(g * â))`` with ``g = dy * γ``, ``dγ = Σ dy * â``, ``dβ = Σ dy``.
The means and rstds are saved per row (the reserve's lnstat_l), the raw products too (W x: wx_l, R h: rh_l); the
raw c' is the reserve's c_l.
"""
from __future__ import annotations

import numpy as np

from ..cells.spec import NORMALISED

EPS = 1e-5


def stat_columns(cell, name: str) -> slice:
    """The (mean, rstd) columns of `name` ("wx", "rh" or "c") in a row of lnstat_l [.., 2K]."""
    k = [n for n in NORMALISED if n in cell.layer_norm].index(name)
    return slice(2 * k, 2 * k + 2)


def normalise(a):
    """a [..., N] -> (â [..., N], stats [..., 2] = (mean, rstd)) across the last axis."""
    mean = a.mean(axis=-1)                                          # [...]
    rstd = 1.0 / np.sqrt(((a - mean[..., None]) ** 2).mean(axis=-1) + EPS)
    return (a - mean[..., None]) * rstd[..., None], np.stack([mean, rstd], axis=-1)


def normalised(a, stats):
    """â from a [..., N] and its saved stats [..., 2]."""
    return (a - stats[..., :1]) * stats[..., 1:]


def backward(dy, a_hat, stats, gain):
    """dL/da [..., N] of y = â * gain (+ β) from dy [..., N] (gain [N])."""
    g = dy * gain
    return stats[..., 1:] * (g - g.mean(axis=-1, keepdims=True) - a_hat * (g * a_hat).mean(axis=-1, keepdims=True))

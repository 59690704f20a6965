"""The reserve_space layout (SPEC 7): what backward needs, saved by a training forward call.

One layout for every backend, so a reserve written by the kernels can be read by the reference and
vice versa, and so `numbarnn explain` can show it.  All arrays are time-major and indexed by the
*original* time index t (the reverse direction writes step s of sequence b at t = len[b]-1-s).
Entries at t >= len[b] are 0.  In the input's dtype::

    for l in 0..L-1:     acts_l  [D, T, B, S*H]   gate activations of both directions (S per cell, below)
                         c_l     [D, T, B, H]     LSTM: the cell state c' after step t
                         m_l     [D, T, B, H]     LSTM with projection: o*tanh(c'), the projection's input
                         y_l     [T, B, D*P]      layer l's output h' (before dropout; y_{L-1} is `output`)
    for l in 1..L-1:     keep_l  [T, B, D*P]      dropout keep flags 0/1 of layer l's input (training, p > 0)

Grouping by layer lets one kernel launch serve both directions of a layer with plain views.

Activations per cell (S) are the cell's `saved` names (numbarnn.cells): lstm i, f, g, o (4); gru r, z, n
and hn = R_n h + bR_n, the recurrent part that the reset gate multiplies (4); rnn_tanh / rnn_relu h' (1).
c_l exists for cells with a cell state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import RNNCall


@dataclass(frozen=True)
class ReserveEntry:
    name: str
    offset: int
    shape: tuple
    meaning: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def reserve_entries(call: RNNCall) -> list[ReserveEntry]:
    cfg, T, B = call.config, call.T, call.B
    H, P, D, S, saved = cfg.H, cfg.P, cfg.D, cfg.cell.S, cfg.cell.saved
    out, offset = [], 0

    def add(name, shape, meaning):
        nonlocal offset
        out.append(ReserveEntry(name, offset, tuple(shape), meaning))
        offset += out[-1].size

    for layer in range(cfg.L):
        add(f"acts{layer}", (D, T, B, S * H), f"layer {layer}: activations {', '.join(saved)} per direction")
        if cfg.has_cell_state:
            add(f"c{layer}", (D, T, B, H), f"layer {layer}: cell state c' after each step")
        if cfg.has_proj:
            add(f"m{layer}", (D, T, B, H), f"layer {layer}: o*tanh(c'), the input of the projection")
        add(f"y{layer}", (T, B, D * P), f"layer {layer}: output h' (before dropout)")
    if call.dropout_active:
        for layer in range(1, cfg.L):
            add(f"keep{layer}", (T, B, D * P), f"layer {layer}: dropout keep flags (0/1) of its input")
    return out


def reserve_size(call: RNNCall) -> int:
    """Elements of reserve_space for a training call (0 for inference)."""
    if not call.is_training:
        return 0
    return sum(e.size for e in reserve_entries(call))


def reserve_views(call: RNNCall, reserve) -> dict:
    """name -> view of `reserve` (NumPy or device array: slicing and reshape only)."""
    return {e.name: reserve[e.offset:e.offset + e.size].reshape(e.shape) for e in reserve_entries(call)}

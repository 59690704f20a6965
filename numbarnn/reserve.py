"""The reserve_space layout (SPEC 7): what backward needs, saved by a training forward call.

One layout for every backend, so a reserve written by the kernels can be read by the reference and
vice versa, and so `numbarnn explain` can show it.  All arrays are time-major and indexed by the
*original* time index t (the reverse direction writes step s of sequence b at t = len[b]-1-s).
Entries at t >= len[b] are 0.  In the input's dtype::

    for l in 0..L-1:     acts_l  [D, T, B, S*H]   gate activations of both directions (S per cell, below)
                         c_l     [D, T, B, H]     LSTM: the cell state c' after step t
                         m_l     [D, T, B, H]     LSTM with projection: o*tanh(c'), the projection's input
                         mod_l   [D, T, B, H]     a modulated cell (CellSpec.modulated): the modulation m
                         lnstat_l [D, T, B, 2K]   a layer-normalised cell (SPEC 13): mean, rstd of each of its K
                                                  normalised quantities (wx, rh, c in that order)
                         wx_l    [D, T, B, G*H]   ... normalising "wx": the raw W x of each step
                         rh_l    [D, T, B, G*H]   ... normalising "rh": the raw R h of each step
                         y_l     [T, B, D*P]      layer l's output h' (before dropout; y_{L-1} is `output`)
    for l in 0..L-1:     zmask_l [D, T, B, P]     zoneout mask 0/1 of h' (training, zoneout > 0; 1 = h takes h_new)
    for l in 1..L-1:     keep_l  [T, B, D*P]      dropout keep flags 0/1 of layer l's input (training, p > 0)
    last:                nonce   [4]              this forward call's random tag, also recorded in host_reserved

Grouping by layer lets one kernel launch serve both directions of a layer with plain views.

Activations per cell (S) are the cell's `saved` names (numbarnn.cells): lstm i, f, g, o (4); gru r, z, n
and hn = R_n h + bR_n, the recurrent part that the reset gate multiplies (4); rnn_tanh / rnn_relu h' (1).
c_l exists for cells with a cell state.

The nonce pairs a reserve with its host_reserved: every training forward call draws NONCE_SIZE random integers
in [1024, 2048) (exact in float16), the op writes them into the reserve's last elements and records them in
host_reserved, and backprop reads them back, so a reserve_space from another forward call of the same size
is an error instead of a silently wrong gradient.  Compare two calls' reserves with `reserve_contents`.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:                 # annotations only: config imports reserve (the nonce), not the other way
    from .config import RNNCall

#: elements of the nonce entry (the last entry of every training reserve)
NONCE_SIZE = 4


@dataclass(frozen=True)
class ReserveEntry:
    name: str
    offset: int
    shape: tuple
    meaning: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def reserve_entries(call: RNNCall) -> tuple[ReserveEntry, ...]:
    """The named regions of a training call's reserve, in order (worked out once per call signature and cell;
    symbolic shapes, torch.compile's SymInts, are not hashable: worked out every time)."""
    try:
        hash(call)
    except TypeError:
        return _entries.__wrapped__(call, call.config.cell)
    return _entries(call, call.config.cell)


@functools.lru_cache(maxsize=256)
def _entries(call: RNNCall, cell) -> tuple[ReserveEntry, ...]:
    cfg, T, B = call.config, call.T, call.B
    H, P, D, S, saved = cfg.H, cfg.P, cfg.D, cell.S, cell.saved
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
        if cell.modulated:
            add(f"mod{layer}", (D, T, B, H), f"layer {layer}: the modulation m of the state (R_g (m ⊙ h) for "
                                             f"gates {', '.join(cell.modulated)})")
        if cell.layer_norm:
            K = len(cell.layer_norm)
            what = ", ".join(n for n in ("wx", "rh", "c") if n in cell.layer_norm)
            add(f"lnstat{layer}", (D, T, B, 2 * K), f"layer {layer}: mean, rstd of the normalised {what}")
            if "wx" in cell.layer_norm:
                add(f"wx{layer}", (D, T, B, cell.G * H), f"layer {layer}: W x of each step (before its layer norm)")
            if "rh" in cell.layer_norm:
                add(f"rh{layer}", (D, T, B, cell.G * H), f"layer {layer}: R h of each step (before its layer norm)")
        add(f"y{layer}", (T, B, D * P), f"layer {layer}: output h' (before dropout)")
    if call.zoneout_active:
        for layer in range(cfg.L):
            add(f"zmask{layer}", (D, T, B, P), f"layer {layer}: zoneout mask (1 = h takes h_new, 0 = keeps h_prev)")
    if call.dropout_active:
        for layer in range(1, cfg.L):
            add(f"keep{layer}", (T, B, D * P), f"layer {layer}: dropout keep flags (0/1) of its input")
    add("nonce", (NONCE_SIZE,), "this forward call's random tag (also in host_reserved; backprop checks it)")
    return tuple(out)


def reserve_size(call: RNNCall) -> int:
    """Elements of reserve_space for a training call (0 for inference)."""
    if not call.is_training:
        return 0
    return sum(e.size for e in reserve_entries(call))


def reserve_views(call: RNNCall, reserve) -> dict:
    """name -> view of `reserve` (NumPy or device array: slicing and reshape only)."""
    try:
        slices = _slices(call, call.config.cell)
    except TypeError:                                  # (unhashable symbolic shapes: worked out every time)
        slices = _slices.__wrapped__(call, call.config.cell)
    return {name: reserve[start:stop].reshape(shape) for name, start, stop, shape in slices}


@functools.lru_cache(maxsize=256)
def _slices(call: RNNCall, cell) -> tuple:
    """(name, start, stop, shape) of each entry of `reserve_entries` (once per call signature and cell: a small
    call spent ~5 us a call on the sizes)."""
    return tuple((e.name, e.offset, e.offset + e.size, e.shape) for e in _entries.__wrapped__(call, cell))


def new_nonce() -> list:
    """NONCE_SIZE random integers in [1024, 2048): exact in float16, four digits each (host_reserved keeps
    one size); drawn from fresh OS entropy, not from the op seeds (os.urandom: two bytes per value, whose
    low 10 bits are uniform on [0, 1024); ~1 us, where seeding a NumPy Generator took ~30 us of every call)."""
    raw = os.urandom(2 * NONCE_SIZE)
    return [1024 + (int.from_bytes(raw[2 * k:2 * k + 2], "little") & 1023) for k in range(NONCE_SIZE)]


def write_nonce(reserve, nonce) -> None:
    """Write `nonce` into the last NONCE_SIZE elements of a training reserve (NumPy or device array)."""
    tail = reserve[reserve.shape[0] - NONCE_SIZE:]
    values = np.asarray(nonce, dtype=reserve.dtype)
    if isinstance(tail, np.ndarray):
        tail[...] = values
    else:
        _device(tail).copy_to_device(values)


def read_nonce(reserve) -> list:
    """The nonce stored in a training reserve (a NONCE_SIZE-element copy, also from a device array)."""
    tail = reserve[reserve.shape[0] - NONCE_SIZE:]
    if not isinstance(tail, np.ndarray):
        tail = _device(tail).copy_to_host()
    return np.asarray(tail, dtype=np.float64).tolist()          # (Python floats)


def reserve_contents(reserve):
    """The reserve without its nonce: what two forward calls on the same inputs reproduce bit for bit."""
    return reserve[:reserve.shape[0] - NONCE_SIZE] if reserve.shape[0] else reserve


def _device(a):
    if hasattr(a, "copy_to_host"):
        return a
    from numba import cuda  # lazy: numba.cuda after the simulator switch
    return cuda.as_cuda_array(a)

"""Parameters: the opaque buffer layout (SPEC 4.2), the canonical lists (4.3), PyTorch and TF formats (4.4).

The opaque `params` buffer, in the empirical cuDNN standard layout::

    for p in 0..L*D-1:  W_0 .. W_{G-1}, R_0 .. R_{G-1}, [W_proj]     # every matrix, flattened C-order
    for p in 0..L*D-1:  bW_0 .. bW_{G-1}, bR_0 .. bR_{G-1}, [V_0 .. V_{V-1}]   # then every bias (+ cell vectors)

Matrices are row-major ``[out, in]`` so a gate is ``M @ v``: W ``[H, I_l]``, R ``[H, P]``, W_proj ``[P, H]``,
biases ``[H]``.  A cell with a diagonal recurrence (IndRNN: rh_g = u_g ⊙ h + bR_g) holds a vector u_g ``[H]`` in
each R_g slot (the same linear-layer ids G+g; no projection is possible), so R of a pseudo-layer reads ``[G*H]``.
With skip_input the layer-0 W matrices are absent (size 0); their biases remain.  Cells with
per-unit parameter vectors (a registered cell's `vectors`, e.g. peepholes; none for the cuDNN cells) keep
them ``[H]`` each right after the pseudo-layer's biases, so one layer's per-unit parameters read as one
``[D, 2G+V, H]`` view.  The canonical weight list holds matrices then vectors, in buffer order.

A layer-normalised cell (SPEC 13) keeps its normalisation vectors (gains, the state's bias) ``[H]`` each after
every bias, at the very end of the buffer: per pseudo-layer ``[NV, H]`` (`CellSpec.norm_groups`).

`param_regions(cfg)` lists every region (offset, shape, meaning) once; everything else here, and the
`explain` view of the CLI, is derived from it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .config import RNNConfig, params_size
from .validation import as_array, check_rank, check_same_dtype, check_shape, shape_of


@dataclass(frozen=True)
class Region:
    """One matrix or bias vector of the opaque buffer."""

    kind: str        # "W", "R", "W_proj", "bW", "bR", "V" (a cell vector) or "N" (a normalisation vector)
    p: int           # pseudo-layer l*D + d
    layer: int
    direction: int   # 0 forward, 1 reverse
    gate: int        # gate index in cuDNN order (-1 for W_proj; the vector index for V)
    linear_id: int   # cuDNN linear-layer id (SPEC 4.1): bias k goes with matrix k
    shape: tuple
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_bias(self) -> bool:
        return self.kind in ("bW", "bR")

    def describe(self, cfg: RNNConfig) -> str:
        if self.kind == "V":
            gate = f" {cfg.cell.vectors[self.gate]}"
        elif self.kind == "N":
            gate = f" {_norm_vector_name(cfg, self.gate)}"
        else:
            gate = "" if self.gate < 0 else f" gate {cfg.gate_names[self.gate]}"
        way = "fwd" if self.direction == 0 else "rev"
        diagonal = " (diagonal: u, rh = u ⊙ h)" if self.kind == "R" and cfg.cell.diagonal else ""
        return f"layer {self.layer} {way} {self.kind}{gate}{diagonal}"


@functools.lru_cache(maxsize=256)
def param_regions(cfg: RNNConfig) -> tuple[Region, ...]:
    """Every region of the opaque buffer, in buffer order (cached per config: every op call asks)."""
    G, H, P, V = cfg.G, cfg.H, cfg.P, cfg.V
    regions, offset = [], 0

    def add(kind, p, layer, d, gate, linear_id, shape):
        nonlocal offset
        regions.append(Region(kind, p, layer, d, gate, linear_id, tuple(shape), offset))
        offset += regions[-1].size

    for p, layer, d in cfg.pseudo_layers():                  # all matrices first
        if cfg.has_w(layer):
            for g in range(G):
                add("W", p, layer, d, g, g, (H, cfg.layer_input_size(layer)))
        for g in range(G):
            add("R", p, layer, d, g, G + g, cfg.recurrent_shape)
        if cfg.has_proj:
            add("W_proj", p, layer, d, -1, 2 * G, (P, H))
    for p, layer, d in cfg.pseudo_layers():                  # then all biases
        for g in range(G):
            add("bW", p, layer, d, g, g, (H,))
        for g in range(G):
            add("bR", p, layer, d, g, G + g, (H,))
        for k in range(V):
            add("V", p, layer, d, k, 2 * G + 1 + k, (H,))
    for p, layer, d in cfg.pseudo_layers():                  # then the normalisation vectors (SPEC 13)
        for k in range(cfg.cell.NV):
            add("N", p, layer, d, k, 2 * G + 1 + V + k, (H,))
    return tuple(regions)


def _norm_vector_name(cfg: RNNConfig, k: int) -> str:
    """The k-th normalisation vector of a pseudo-layer: 'ln_wx_gain i', 'ln_c_bias', ..."""
    for name, count in cfg.cell.norm_groups:
        if k < count:
            return f"{name} {cfg.gate_names[k]}" if count > 1 else name
        k -= count
    raise IndexError(k)


def canonical_weight_shapes(cfg: RNNConfig) -> list[tuple]:
    return [r.shape for r in param_regions(cfg) if not r.is_bias]


def canonical_bias_shapes(cfg: RNNConfig) -> list[tuple]:
    return [r.shape for r in param_regions(cfg) if r.is_bias]


def _canonical_order(cfg: RNNConfig) -> tuple[list[Region], list[Region]]:
    """SPEC 4.3 orders pseudo-layer by pseudo-layer, which is buffer order for weights and for biases."""
    regions = param_regions(cfg)
    return [r for r in regions if not r.is_bias], [r for r in regions if r.is_bias]


def check_params(cfg: RNNConfig, params, name: str = "params"):
    params = as_array(name, params)
    check_rank(name, params, 1, "(a 1-D opaque buffer)")
    n = params_size(cfg)
    if shape_of(params)[0] != n:
        raise ValueError(f"{name}: expected length params_size = {n} for this configuration, got {shape_of(params)[0]}")
    check_same_dtype({name: params})
    return params


def params_to_canonical(cfg: RNNConfig, params) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Opaque buffer -> (weights, biases), fresh arrays shaped as SPEC 4.1 in SPEC 4.3 order."""
    params = np.asarray(check_params(cfg, params))
    w_regions, b_regions = _canonical_order(cfg)
    take = [params[r.offset:r.offset + r.size].reshape(r.shape).copy() for r in w_regions + b_regions]
    return take[:len(w_regions)], take[len(w_regions):]


def canonical_to_params(cfg: RNNConfig, weights, biases, dtype=None) -> np.ndarray:
    """(weights, biases) in SPEC 4.3 order -> a fresh opaque buffer."""
    w_regions, b_regions = _canonical_order(cfg)
    for name, given, regions in (("weights", weights, w_regions), ("biases", biases, b_regions)):
        if len(given) != len(regions):
            raise ValueError(f"{name}: expected {len(regions)} arrays for this configuration, got {len(given)}")
    arrays = [as_array(f"weights[{k}]", w) for k, w in enumerate(weights)] + \
             [as_array(f"biases[{k}]", b) for k, b in enumerate(biases)]
    names = [f"weights[{k}]" for k in range(len(weights))] + [f"biases[{k}]" for k in range(len(biases))]
    if dtype is None:
        dtype = check_same_dtype(dict(zip(names, arrays)))
    out = np.empty(params_size(cfg), dtype=dtype)
    for name, a, r in zip(names, arrays, w_regions + b_regions):
        check_shape(name, a, r.shape, f"{r.describe(cfg)}")
        out[r.offset:r.offset + r.size] = np.asarray(a).reshape(-1)
    return out


@dataclass
class LayerParams:
    """Views of one pseudo-layer's parameters, gates stacked along the first axis (cuDNN order)."""

    W: np.ndarray | None       # [G*H, I_l]  (None: skip_input layer 0, W = identity per gate)
    R: np.ndarray              # [G*H, P]    (diagonal recurrence: [G*H], the vectors u_g stacked)
    W_proj: np.ndarray | None  # [P, H]      (None without projection)
    bW: np.ndarray             # [G*H]
    bR: np.ndarray             # [G*H]
    V: np.ndarray | None = None   # [V, H]   cell vectors (None for cells without)
    N: np.ndarray | None = None   # [NV, H]  normalisation vectors (SPEC 13; None without layer_norm)

    def norm(self, cell, name: str):
        """One group of the normalisation vectors, flat: 'ln_wx_gain' [G*H], 'ln_c_bias' [H], ... (None when the
        cell does not normalise it)."""
        start = 0
        for group, count in cell.norm_groups:
            if group == name:
                return self.N[start:start + count].reshape(-1)
            start += count
        return None


def unpack(cfg: RNNConfig, params) -> list[LayerParams]:
    """Per pseudo-layer views into `params` (NumPy or device array: only slicing and reshape are used).

    A pseudo-layer's gates are contiguous in the buffer, so W_0..W_{G-1} read as one [G*H, I_l] matrix.
    """
    return [LayerParams(*[None if s is None else params[s[0]:s[1]].reshape(s[2]) for s in slices])
            for slices in _layer_slices(cfg, cfg.cell)]


@functools.lru_cache(maxsize=256)
def _layer_slices(cfg: RNNConfig, cell) -> tuple:
    """`_layer_spans` as (start, stop, shape) or None (`unpack`: no sizes worked out per call)."""
    return tuple(tuple(None if sp is None else (sp[0], sp[0] + math.prod(sp[1]), sp[1]) for sp in spans)
                 for spans in _layer_spans(cfg, cell))


@functools.lru_cache(maxsize=256)
def _layer_spans(cfg: RNNConfig, cell) -> tuple:
    """Per pseudo-layer, (offset, shape) or None of W, R, W_proj, bW, bR, V, N (LayerParams' order): worked out
    once per configuration and cell (`unpack` runs at every call)."""
    G, H, P, V = cfg.G, cfg.H, cfg.P, cfg.V
    first = {}
    for r in param_regions(cfg):
        first.setdefault((r.p, r.kind), r)

    def span(p, kind, shape):
        r = first.get((p, kind))
        return None if r is None else (r.offset, shape)

    R = (G * H,) if cfg.cell.diagonal else (G * H, P)
    return tuple((span(p, "W", (G * H, cfg.layer_input_size(layer))), span(p, "R", R),
                  span(p, "W_proj", (P, H)), span(p, "bW", (G * H,)), span(p, "bR", (G * H,)),
                  span(p, "V", (V, H)), span(p, "N", (cfg.cell.NV, H)))
                 for p, layer, _ in cfg.pseudo_layers())


# ---------------------------------------------------------------------------------------------------
# PyTorch nn.LSTM / nn.GRU / nn.RNN state_dict (plain arrays; no torch import)
# ---------------------------------------------------------------------------------------------------

def _suffix(layer: int, d: int) -> str:
    return f"_l{layer}" + ("_reverse" if d else "")


def _stacked_w(cfg: RNNConfig, lp: LayerParams, layer: int) -> np.ndarray:
    """W stacked [G*H, I_l]; for skip_input layer 0 the identity per gate (the same math)."""
    if lp.W is not None:
        return np.asarray(lp.W)
    return np.tile(np.eye(cfg.H, dtype=np.asarray(lp.R).dtype), (cfg.G, 1))


def to_torch_state_dict(cfg: RNNConfig, params) -> dict:
    """Opaque params -> a dict of NumPy arrays named as torch.nn.LSTM/GRU/RNN's state_dict.

    skip_input has no PyTorch equivalent: its layer-0 W is exported as identity per gate (same outputs).
    A diagonal recurrence's weight_hh is the stacked vectors u_g, [G*H].
    """
    params = np.asarray(check_params(cfg, params))
    sd = {}
    for (p, layer, d), lp in zip(cfg.pseudo_layers(), unpack(cfg, params)):
        s = _suffix(layer, d)
        sd["weight_ih" + s] = _stacked_w(cfg, lp, layer).copy()
        sd["weight_hh" + s] = np.asarray(lp.R).copy()
        sd["bias_ih" + s] = np.asarray(lp.bW).copy()
        sd["bias_hh" + s] = np.asarray(lp.bR).copy()
        if cfg.has_proj:
            sd["weight_hr" + s] = np.asarray(lp.W_proj).copy()
        for k, name in enumerate(cfg.cell.vectors):          # a registered cell's vectors: <name>_l0, ...
            sd[name + s] = np.asarray(lp.V[k]).copy()
        for name, _ in cfg.cell.norm_groups:                 # normalisation vectors: ln_wx_gain_l0 [G*H], ...
            sd[name + s] = np.asarray(lp.norm(cfg.cell, name)).copy()
    return sd


def from_torch_state_dict(cfg: RNNConfig, state_dict: dict, dtype=None) -> np.ndarray:
    """A torch.nn.LSTM/GRU/RNN state_dict (tensors or arrays) -> opaque params.

    Missing biases (``bias=False``) are zeros. For skip_input, layer 0's weight_ih must be identity per gate.
    """
    def arr(v):
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        return np.asarray(v)

    sd = {k: arr(v) for k, v in state_dict.items()}
    if dtype is None:
        dtype = next((v.dtype for k, v in sd.items() if k.startswith("weight_hh")), np.float32)
    out = np.zeros(params_size(cfg), dtype=dtype)
    views = unpack(cfg, out)
    G, H = cfg.G, cfg.H
    expected = {f"weight_ih{_suffix(l, d)}" for _, l, d in cfg.pseudo_layers()} | \
               {f"weight_hh{_suffix(l, d)}" for _, l, d in cfg.pseudo_layers()}
    missing = sorted(expected - set(sd))
    if missing:
        raise ValueError(f"state_dict: missing {', '.join(missing)} for this configuration")
    for (p, layer, d), lp in zip(cfg.pseudo_layers(), views):
        s = _suffix(layer, d)
        w_ih = sd["weight_ih" + s]
        check_shape("state_dict['weight_ih%s']" % s, w_ih, (G * H, cfg.layer_input_size(layer)), "[G*H, I_l]")
        if lp.W is None:
            if not np.array_equal(w_ih, np.tile(np.eye(H), (G, 1))):
                raise ValueError(f"state_dict['weight_ih{s}']: skip_input has no layer-0 input weights; "
                                 f"expected identity per gate")
        else:
            lp.W[...] = w_ih
        check_shape("state_dict['weight_hh%s']" % s, sd["weight_hh" + s], lp.R.shape,
                    "[G*H] (a diagonal recurrence: u_g stacked)" if cfg.cell.diagonal else "[G*H, P]")
        lp.R[...] = sd["weight_hh" + s]
        for key, dst in (("bias_ih", lp.bW), ("bias_hh", lp.bR)):
            if key + s in sd:
                check_shape(f"state_dict['{key}{s}']", sd[key + s], (G * H,), "[G*H]")
                dst[...] = sd[key + s]
        if cfg.has_proj:
            if "weight_hr" + s not in sd:
                raise ValueError(f"state_dict: missing weight_hr{s} (projection)")
            check_shape(f"state_dict['weight_hr{s}']", sd["weight_hr" + s], (cfg.P, H), "[P, H]")
            lp.W_proj[...] = sd["weight_hr" + s]
        for k, name in enumerate(cfg.cell.vectors):
            if name + s not in sd:
                raise ValueError(f"state_dict: missing {name}{s} (cell vector of {cfg.rnn_mode!r})")
            check_shape(f"state_dict['{name}{s}']", sd[name + s], (H,), "[H]")
            lp.V[k] = sd[name + s]
        start = 0
        for name, count in cfg.cell.norm_groups:
            if name + s not in sd:
                raise ValueError(f"state_dict: missing {name}{s} (normalisation vector of {cfg.rnn_mode!r})")
            check_shape(f"state_dict['{name}{s}']", sd[name + s], (count * H,), f"[{count * H}]")
            lp.N[start:start + count] = np.asarray(sd[name + s]).reshape(count, H)
            start += count
    return out


# ---------------------------------------------------------------------------------------------------
# TF "CudnnCompatible" cells (CudnnCompatibleLSTMCell / CudnnCompatibleGRUCell)
# ---------------------------------------------------------------------------------------------------
_TF_LSTM_ORDER = (0, 2, 1, 3)   # TF packs LSTM gates as i, g, f, o; cuDNN order is i, f, g, o


def _check_tf_cell(cfg: RNNConfig) -> None:
    if cfg.rnn_mode not in _TF_CELLS:
        raise ValueError(f"rnn_mode: TF's CudnnCompatible cells exist for {_TF_CELLS}, not for the registered "
                         f"cell {cfg.rnn_mode!r}")


_TF_CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def _cell_prefix(layer: int, d: int, cfg: RNNConfig) -> str:
    return f"cell_{layer}/" + ("" if cfg.D == 1 else ("fw/" if d == 0 else "bw/"))


def to_tf_cells(cfg: RNNConfig, params) -> dict:
    """Opaque params -> {name: array} of TF's CudnnCompatible cell variables, one cell per pseudo-layer.

    Names: ``cell_{l}/[fw/|bw/]`` + LSTM ``kernel [I_l+P, 4H]``, ``bias [4H]``, ``projection/kernel [H, P]``;
    GRU ``gates/kernel [I_l+H, 2H]``, ``gates/bias [2H]``, ``candidate/input_projection/{kernel,bias}``,
    ``candidate/hidden_projection/{kernel,bias}``; RNN modes (BasicRNNCell-like) ``kernel [I_l+H, H]``, ``bias``.
    Only the bias sum bW+bR is stored where TF keeps one bias.
    """
    _check_tf_cell(cfg)
    params = np.asarray(check_params(cfg, params))
    G, H = cfg.G, cfg.H
    out = {}
    for (p, layer, d), lp in zip(cfg.pseudo_layers(), unpack(cfg, params)):
        pre = _cell_prefix(layer, d, cfg)
        W = _stacked_w(cfg, lp, layer).reshape(G, H, -1)     # [G, H, I_l]
        R = np.asarray(lp.R).reshape(G, H, -1)               # [G, H, P]
        bsum = (np.asarray(lp.bW) + np.asarray(lp.bR)).reshape(G, H)
        if cfg.rnn_mode == "gru":
            out[pre + "gates/kernel"] = np.concatenate([np.concatenate([W[g], R[g]], 1) for g in (0, 1)], 0).T.copy()
            out[pre + "gates/bias"] = bsum[:2].reshape(-1).copy()
            out[pre + "candidate/input_projection/kernel"] = W[2].T.copy()
            out[pre + "candidate/input_projection/bias"] = np.asarray(lp.bW).reshape(G, H)[2].copy()
            out[pre + "candidate/hidden_projection/kernel"] = R[2].T.copy()
            out[pre + "candidate/hidden_projection/bias"] = np.asarray(lp.bR).reshape(G, H)[2].copy()
        else:
            order = _TF_LSTM_ORDER if cfg.rnn_mode == "lstm" else (0,)
            out[pre + "kernel"] = np.concatenate([np.concatenate([W[g], R[g]], 1) for g in order], 0).T.copy()
            out[pre + "bias"] = bsum[list(order)].reshape(-1).copy()
            if cfg.has_proj:
                out[pre + "projection/kernel"] = np.asarray(lp.W_proj).T.copy()
    return out


def from_tf_cells(cfg: RNNConfig, cells: dict, dtype=None) -> np.ndarray:
    """TF CudnnCompatible cell variables (names as `to_tf_cells`) -> opaque params.

    A summed bias is split half to bW, half to bR. For skip_input, layer 0's input kernel must be identity.
    """
    _check_tf_cell(cfg)
    cells = {k: np.asarray(v) for k, v in cells.items()}
    if dtype is None:
        dtype = next(iter(cells.values())).dtype if cells else np.float32
    out = np.zeros(params_size(cfg), dtype=dtype)
    G, H = cfg.G, cfg.H

    def get(name, shape, legend):
        if name not in cells:
            raise ValueError(f"cells: missing {name!r} for this configuration")
        check_shape(f"cells[{name!r}]", cells[name], shape, legend)
        return cells[name]

    for (p, layer, d), lp in zip(cfg.pseudo_layers(), unpack(cfg, out)):
        pre, I_l, P = _cell_prefix(layer, d, cfg), cfg.layer_input_size(layer), cfg.P
        W = np.empty((G, H, I_l)) if lp.W is None else lp.W.reshape(G, H, I_l)
        R, bW, bR = lp.R.reshape(G, H, P), lp.bW.reshape(G, H), lp.bR.reshape(G, H)
        if cfg.rnn_mode == "gru":
            k = get(pre + "gates/kernel", (I_l + H, 2 * H), "[I_l+H, 2H]").T.reshape(2, H, I_l + H)
            bias = get(pre + "gates/bias", (2 * H,), "[2H]").reshape(2, H)
            for g in (0, 1):
                W[g], R[g] = k[g, :, :I_l], k[g, :, I_l:]
                bW[g] = bR[g] = bias[g] / 2
            W[2] = get(pre + "candidate/input_projection/kernel", (I_l, H), "[I_l, H]").T
            bW[2] = get(pre + "candidate/input_projection/bias", (H,), "[H]")
            R[2] = get(pre + "candidate/hidden_projection/kernel", (H, H), "[H, H]").T
            bR[2] = get(pre + "candidate/hidden_projection/bias", (H,), "[H]")
        else:
            order = _TF_LSTM_ORDER if cfg.rnn_mode == "lstm" else (0,)
            k = get(pre + "kernel", (I_l + P, G * H), "[I_l+P, G*H]").T.reshape(G, H, I_l + P)
            bias = get(pre + "bias", (G * H,), "[G*H]").reshape(G, H)
            for slot, g in enumerate(order):
                W[g], R[g] = k[slot, :, :I_l], k[slot, :, I_l:]
                bW[g] = bR[g] = bias[slot] / 2
            if cfg.has_proj:
                lp.W_proj[...] = get(pre + "projection/kernel", (H, P), "[H, P]").T
        if lp.W is None and not np.array_equal(W, np.broadcast_to(np.eye(H), W.shape)):
            raise ValueError(f"cells: skip_input has no layer-0 input weights; expected identity kernels in {pre}")
    return out


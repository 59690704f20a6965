"""Argument checks for TensorFlow's BlockLSTM ops (SPEC sections 9 and 11).

``BlockLSTM`` / ``BlockLSTMGrad`` (V1) and ``BlockLSTMV2`` / ``BlockLSTMGradV2`` (V2) differ only in
the order of the four gate blocks along the ``4C`` axis of ``w`` and ``b`` and in their defaults:

=========  ========  =====================  =====================
op         layout    forget_bias default    cell_clip default
=========  ========  =====================  =====================
V1         ``icfo``  1.0                    3.0
V2         ``ifco``  0.0 (no such attr)     0.0 (off)
=========  ========  =====================  =====================

A ``cell_clip`` <= 0 switches the clip off (TF's ``LSTMBlockCell`` passes -1 for "no clip").

Shapes (letters of SPEC section 1, C = cell size)::

    x                          [T, B, I]
    cs_prev, h_prev            [B, C]
    w                          [I + C, 4C]
    wci, wcf, wco              [C]          always required, ignored without peephole
    b                          [4C]
    i, cs, f, o, ci, co, h     [T, B, C]    forward outputs / saved activations for the gradient
    cs_grad, h_grad            [T, B, C]
    seq_len_max                scalar integer, 0 <= seq_len_max <= T

``validate_block_lstm`` / ``validate_block_lstm_grad`` only read ``.shape`` and ``.dtype`` of the
tensors, so NumPy arrays and device arrays are treated alike; nothing is copied or mutated. Both return
a :class:`BlockLSTMCall`, the hashable description of the call that the reference and the kernels use
(and that kernel caches can key on).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from numbarnn.validation import (ArgumentTypeError, 
    as_array,
    check_choice,
    check_int,
    check_rank,
    check_same_dtype,
    check_shape,
    is_device_array,
    reject_torch_tensor,
)

#: the gate blocks along the 4C axis of ``w`` / ``b``, in order: V1 is i|ci|f|o, V2 is i|f|ci|o
GATE_ORDER = {
    "icfo": ("i", "ci", "f", "o"),
    "ifco": ("i", "f", "ci", "o"),
}

#: names of the seven forward outputs, in the order the ops return them
FORWARD_OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")


@dataclass(frozen=True)
class BlockLSTMCall:
    """One validated BlockLSTM(Grad) call.

    ``forget_bias`` and ``cell_clip`` are 0.0 for a gradient call (the gradient ignores both).
    """

    layout: str            # 'icfo' (V1) or 'ifco' (V2)
    seq_len_max: int       # steps actually run, 0 <= seq_len_max <= T
    T: int                 # max time
    B: int                 # batch
    I: int                 # input size
    C: int                 # cell size
    dtype: np.dtype        # float16, float32 or float64, shared by every tensor
    forget_bias: float     # added to the forget gate's pre-activation
    cell_clip: float       # cs is clipped to [-cell_clip, cell_clip] when cell_clip > 0
    use_peephole: bool     # wci / wcf / wco used

    def gate_block(self, gate: str) -> int:
        """Index 0..3 of ``gate`` ('i', 'ci', 'f' or 'o') among the four C-wide blocks of the 4C axis."""
        return GATE_ORDER[self.layout].index(gate)

    def gate_offset(self, gate: str) -> int:
        """First column of ``gate`` in the 4C axis of ``w`` / ``b``."""
        return self.gate_block(gate) * self.C

    @property
    def clip_enabled(self) -> bool:
        return self.cell_clip > 0.0


def _check_seq_len_max(value, T: int) -> int:
    """A scalar integer (Python int, NumPy integer, 0-d integer array) with 0 <= value <= T."""
    name = "seq_len_max"
    reject_torch_tensor(name, value)
    if is_device_array(value):
        shape = tuple(int(s) for s in value.shape)
        if shape != ():
            raise ValueError(f"{name}: expected a scalar integer, got an array of shape {shape}")
        if not hasattr(value, "copy_to_host"):
            raise ArgumentTypeError(f"{name}: expected a host integer or a 0-d numba device array, "
                            f"got {type(value).__name__}")
        value = np.asarray(value.copy_to_host())
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if isinstance(value, np.ndarray) and value.ndim != 0:
        raise ValueError(f"{name}: expected a scalar integer, got an array of shape {value.shape}")
    try:
        return check_int(name, value, minimum=0, maximum=T)
    except ValueError as exc:   # ArgumentTypeError too: keep the class, add the note
        raise type(exc)(f"{exc} (0 <= seq_len_max <= T, T = {T} from x.shape[0])") from None


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name}: expected a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def _check_number(name: str, value) -> float:
    """Any real number but NaN (infinities are allowed: a clip at inf never triggers)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name}: expected a number, got nan")
    return value


def _check_shape_noted(name: str, a, expected: tuple, legend: str, note: str) -> None:
    """check_shape, with a note saying where the expected sizes came from appended to the error."""
    try:
        check_shape(name, a, expected, legend)
    except ValueError as exc:
        raise ValueError(f"{exc} ({note})") from None


def _check_forward_tensors(x, cs_prev, h_prev, w, wci, wcf, wco, b) -> tuple:
    """Shapes of the eight forward inputs; returns (T, B, I, C). Every message names the argument.

    T, B, I come from x; C from cs_prev (a mismatch of b, w, ... with it names that argument).
    """
    T, B, I = check_rank("x", x, 3, "[T, B, I]")
    _, C = check_rank("cs_prev", cs_prev, 2, "[B, C]")
    note = f"T, B, I = {T}, {B}, {I} from x.shape; C = {C} from cs_prev.shape[1]"
    _check_shape_noted("cs_prev", cs_prev, (B, C), "[B, C]", note)
    _check_shape_noted("h_prev", h_prev, (B, C), "[B, C]", note)
    _check_shape_noted("w", w, (I + C, 4 * C), "[I + C, 4C]", note)
    for name, a in (("wci", wci), ("wcf", wcf), ("wco", wco)):
        _check_shape_noted(name, a, (C,), "[C]", note)
    _check_shape_noted("b", b, (4 * C,), "[4C]", note)
    return T, B, I, C


def validate_block_lstm(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b,
                        forget_bias, cell_clip, use_peephole) -> BlockLSTMCall:
    """Check the arguments of BlockLSTM (layout 'icfo') / BlockLSTMV2 (layout 'ifco').

    Raises ``ValueError`` (``TypeError`` for dtypes and non-numbers) naming the bad argument.
    """
    layout = check_choice("layout", layout, tuple(GATE_ORDER))
    tensors = dict(x=x, cs_prev=cs_prev, h_prev=h_prev, w=w, wci=wci, wcf=wcf, wco=wco, b=b)
    tensors = {name: as_array(name, a) for name, a in tensors.items()}
    T, B, I, C = _check_forward_tensors(**tensors)
    dtype = check_same_dtype(tensors)
    return BlockLSTMCall(
        layout=layout,
        seq_len_max=_check_seq_len_max(seq_len_max, T),
        T=T, B=B, I=I, C=C,
        dtype=dtype,
        forget_bias=_check_number("forget_bias", forget_bias),
        cell_clip=_check_number("cell_clip", cell_clip),
        use_peephole=_check_bool("use_peephole", use_peephole),
    )


def validate_block_lstm_grad(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b,
                             i, cs, f, o, ci, co, h, cs_grad, h_grad, use_peephole) -> BlockLSTMCall:
    """Check the arguments of BlockLSTMGrad (layout 'icfo') / BlockLSTMGradV2 (layout 'ifco').

    The returned call has ``forget_bias = cell_clip = 0.0``: the gradient uses neither (it reads the
    saved activations and, as in TF, ignores the clip).
    """
    layout = check_choice("layout", layout, tuple(GATE_ORDER))
    tensors = dict(x=x, cs_prev=cs_prev, h_prev=h_prev, w=w, wci=wci, wcf=wcf, wco=wco, b=b,
                   i=i, cs=cs, f=f, o=o, ci=ci, co=co, h=h, cs_grad=cs_grad, h_grad=h_grad)
    tensors = {name: as_array(name, a) for name, a in tensors.items()}
    T, B, I, C = _check_forward_tensors(**{k: tensors[k] for k in
                                           ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")})
    for name in FORWARD_OUTPUTS + ("cs_grad", "h_grad"):
        _check_shape_noted(name, tensors[name], (T, B, C), "[T, B, C]",
                           f"T, B = {T}, {B} from x.shape; C = {C} from cs_prev.shape[1]")
    dtype = check_same_dtype(tensors)
    return BlockLSTMCall(
        layout=layout,
        seq_len_max=_check_seq_len_max(seq_len_max, T),
        T=T, B=B, I=I, C=C,
        dtype=dtype,
        forget_bias=0.0,
        cell_clip=0.0,
        use_peephole=_check_bool("use_peephole", use_peephole),
    )

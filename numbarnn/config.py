"""The RNN description shared by every backend, and every SPEC section 11 check of the cuDNN ops.

`RNNConfig` is the network (mode, layers, units, sizes, directions, projection, dropout, seeds); `RNNCall`
adds one call's shapes (T, B), dtype and layout. The ops validate once, here, before any backend does
work; backends receive arrays already checked and normalised to time-major.

Letters: T time, B batch, I input size, H num_units, P width of h (num_proj or H), L layers,
D directions, G gates per cell.

Why one file (over 500 lines): the description and every check of it are read together: each check's message
names a field the description defines, and the ops, the layers and numbarnn.torch import both.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from .cells import CellSpec, cell_names, get_cell, registered_cell
from .reserve import read_nonce
from .validation import (ArgumentTypeError, as_array, check_choice, check_float, check_int, check_rank, check_same_dtype,
                         check_shape, is_device_array, reject_torch_tensor, shape_of)

INPUT_MODES = ("linear_input", "skip_input", "auto_select")
DIRECTIONS = ("unidirectional", "bidirectional")


@dataclass(frozen=True)
class RNNConfig:
    """A validated network description.  `input_mode` is resolved: never "auto_select"."""

    rnn_mode: str
    num_layers: int      # L
    num_units: int       # H
    input_size: int      # I
    input_mode: str = "linear_input"
    direction: str = "unidirectional"
    num_proj: int = 0    # 0 = no projection, else P
    dropout: float = 0.0
    seed: int = 0
    seed2: int = 0
    zoneout: float = 0.0   # haste's zoneout probability of the state h (SPEC 6.1); 0 = none

    # fixed letters ------------------------------------------------------------------------------
    @property
    def L(self) -> int:
        return self.num_layers

    @property
    def H(self) -> int:
        return self.num_units

    @property
    def I(self) -> int:  # noqa: E743 - the SPEC's letter
        return self.input_size

    @property
    def cell(self) -> CellSpec:
        """The registered description of rnn_mode: everything that differs between cells comes from it."""
        return get_cell(self.rnn_mode)

    @property
    def G(self) -> int:
        return self.cell.G

    @property
    def V(self) -> int:
        """Per-unit parameter vectors of the cell (peepholes, ...); 0 for the cuDNN cells."""
        return self.cell.V

    @property
    def D(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    @property
    def P(self) -> int:
        return self.num_proj if self.num_proj else self.num_units

    @property
    def has_proj(self) -> bool:
        return self.num_proj > 0

    @property
    def skip_input(self) -> bool:
        return self.input_mode == "skip_input"

    @property
    def has_cell_state(self) -> bool:
        """input_c / output_c carry a cell state (LSTM-like cells)."""
        return self.cell.cell_state

    @property
    def recurrent_shape(self) -> tuple:
        """The shape of one gate's recurrent weight: R_g [H, P], or u_g [H] for a diagonal recurrence."""
        return (self.H,) if self.cell.diagonal else (self.H, self.P)

    @property
    def recurrent_size(self) -> int:
        return self.H if self.cell.diagonal else self.H * self.P

    @property
    def gate_names(self) -> tuple:
        return self.cell.gates

    def layer_input_size(self, layer: int) -> int:
        """I_l: I for layer 0, D*P above."""
        return self.I if layer == 0 else self.D * self.P

    def has_w(self, layer: int) -> bool:
        """False for the layer-0 W matrices of skip_input (x is added to every gate: W = identity)."""
        return not (self.skip_input and layer == 0)

    def pseudo_layers(self):
        """(p, l, d) for p = l*D + d: forward of layer l, then its reverse."""
        for layer in range(self.L):
            for d in range(self.D):
                yield layer * self.D + d, layer, d


def rnn_config(num_layers, num_units, input_size, rnn_mode="lstm", input_mode="linear_input",
               direction="unidirectional", num_proj=0, dropout=0.0, seed=0, seed2=0, zoneout=0.0) -> RNNConfig:
    """Validate the op attributes (SPEC 3, 11) and resolve auto_select."""
    cell = get_cell(check_choice("rnn_mode", rnn_mode, cell_names()))
    input_mode = check_choice("input_mode", input_mode, INPUT_MODES)
    direction = check_choice("direction", direction, DIRECTIONS)
    L = check_int("num_layers", num_layers, minimum=1)
    H = check_int("num_units", num_units, minimum=1)
    I = check_int("input_size", input_size, minimum=1)  # noqa: E741
    num_proj = 0 if num_proj is None else check_int("num_proj", num_proj, minimum=0)
    if num_proj and not cell.projection:
        allowed = [n for n in cell_names() if get_cell(n).projection]
        raise ValueError(f"num_proj: projection is only defined for rnn_mode in {allowed}, got num_proj={num_proj} "
                         f"with rnn_mode={rnn_mode!r}")
    if num_proj > H:
        raise ValueError(f"num_proj: expected 0 < num_proj <= num_units = {H}, got {num_proj}")
    dropout = check_float("dropout", dropout, 0.0, 1.0)
    seed = check_int("seed", seed)
    seed2 = check_int("seed2", seed2)
    zoneout = check_zoneout(zoneout)
    if input_mode == "auto_select":
        input_mode = "skip_input" if I == H else "linear_input"
    elif input_mode == "skip_input" and I != H:
        raise ValueError(f"input_mode: 'skip_input' requires input_size == num_units, got input_size={I}, "
                         f"num_units={H}")
    return RNNConfig(rnn_mode, L, H, I, input_mode, direction, num_proj, dropout, seed, seed2, zoneout)


def check_zoneout(zoneout) -> float:
    """haste's zoneout probability: a real number in [0, 1) (1 would freeze the state for ever)."""
    if isinstance(zoneout, (bool, np.bool_)) or not isinstance(zoneout, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"zoneout: expected a float in [0, 1), got {type(zoneout).__name__} {zoneout!r}")
    zoneout = float(zoneout)
    if not 0.0 <= zoneout < 1.0:          # (NaN fails too)
        raise ValueError(f"zoneout: expected a probability in [0, 1), got {zoneout!r}")
    return zoneout


def params_size(cfg: RNNConfig) -> int:
    """SPEC 4.2: sum_p [G*H*I_p (not skip layer 0) + G*H*P + P*H (projection)] + L*D*(2*G + V)*H.
    A cell with a diagonal recurrence holds G vectors u_g [H] where the others hold the G matrices R_g [H, P].

    The element count of the opaque buffer; `params.param_regions` lists the same regions one by one (a test
    checks they agree).  Here so that validation needs no import of params (no import cycle).
    """
    G, H, P = cfg.G, cfg.H, cfg.P
    n = 0
    for _, layer, _ in cfg.pseudo_layers():
        n += (G * H * cfg.layer_input_size(layer) if cfg.has_w(layer) else 0) + G * cfg.recurrent_size
        n += P * H if cfg.has_proj else 0
    return n + cfg.L * cfg.D * (2 * G + cfg.V) * H + cfg.L * cfg.D * cfg.cell.NV * H     # (+ SPEC 13's vectors)


@dataclass(frozen=True)
class RNNCall:
    """One forward/backward call: the config plus shapes, dtype and layout."""

    config: RNNConfig
    T: int
    B: int
    dtype: np.dtype
    time_major: bool = True
    is_training: bool = True
    lengths: tuple = field(default=(), repr=False)   # B ints, each in [0, T]; all T when None was given

    @property
    def dropout_active(self) -> bool:
        """Dropout applies to the inputs of layers 1..L-1, only in training with p > 0."""
        return self.is_training and self.config.dropout > 0.0 and self.config.L > 1

    @property
    def zoneout_active(self) -> bool:
        """Training with zoneout > 0: each step keeps h_prev where the Philox mask is 0 (SPEC 6.1, reserve zmask_l)."""
        return self.is_training and self.config.zoneout > 0.0

    @property
    def zoneout_expected(self) -> bool:
        """Inference with zoneout > 0: h' = p*h_prev + (1-p)*h_new, zoneout's expectation (SPEC 6.1)."""
        return not self.is_training and self.config.zoneout > 0.0

    def lengths_array(self) -> np.ndarray:
        return np.asarray(self.lengths, dtype=np.int32).reshape(self.B)

    def fingerprint(self) -> dict:
        """What host_reserved records about the forward call (SPEC 7): a fresh dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in _fingerprint(self)}

    def _fingerprint_dict(self) -> dict:
        c = self.config
        return {"rnn_mode": c.rnn_mode, "input_mode": c.input_mode, "direction": c.direction,
                "num_layers": c.L, "num_units": c.H, "input_size": c.I, "num_proj": c.num_proj,
                "dropout": c.dropout if self.dropout_active else 0.0,
                "seed": c.seed if self.dropout_active else 0, "seed2": c.seed2 if self.dropout_active else 0,
                "T": self.T, "B": self.B, "dtype": str(self.dtype), "time_major": self.time_major,
                "lengths": self.lengths,
                **({"zoneout": c.zoneout, "zoneout_seed": c.seed, "zoneout_seed2": c.seed2}
                   if self.zoneout_active else {})}


@functools.lru_cache(maxsize=256)
def _fingerprint(call: RNNCall) -> tuple:
    """RNNCall.fingerprint as (key, value) pairs, once per call signature (lengths kept as a tuple)."""
    return tuple(call._fingerprint_dict().items())


# ---------------------------------------------------------------------------------------------------
# array checks of one call
# ---------------------------------------------------------------------------------------------------

def _lengths(sequence_lengths, T: int, B: int) -> tuple:
    """SPEC 5: int32-compatible [B], each 0 <= len <= T; None = all T."""
    if sequence_lengths is None:
        return (T,) * B
    if is_device_array(sequence_lengths):
        sequence_lengths = sequence_lengths.copy_to_host() if hasattr(sequence_lengths, "copy_to_host") \
            else np.asarray(sequence_lengths)
    lens = np.asarray(sequence_lengths)
    if lens.dtype == object or not (np.issubdtype(lens.dtype, np.integer)):
        raise ArgumentTypeError(f"sequence_lengths: expected integers (int32), got dtype {lens.dtype}")
    if lens.ndim != 1:
        raise ValueError(f"sequence_lengths: expected rank 1 with shape (B,) = ({B},), got rank {lens.ndim} "
                         f"with shape {lens.shape}")
    if lens.shape[0] != B:
        raise ValueError(f"sequence_lengths: expected {B} lengths (one per batch entry), got {lens.shape[0]}")
    bad = np.flatnonzero((lens < 0) | (lens > T))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"sequence_lengths: expected every length in [0, T={T}], got {int(lens[b])} at index {b}")
    return tuple(int(v) for v in lens)


def state_shapes(call: RNNCall) -> tuple[tuple, tuple]:
    """User-facing shapes of (h, c) states in the call's layout."""
    c = call.config
    LD = c.L * c.D
    if call.time_major:
        return (LD, call.B, c.P), (LD, call.B, c.H)
    return (call.B, LD, c.P), (call.B, LD, c.H)


def output_shape(call: RNNCall) -> tuple:
    c = call.config
    return (call.T, call.B, c.D * c.P) if call.time_major else (call.B, call.T, c.D * c.P)



_VALIDATED: dict = {}       # signature of a call that passed validate_forward -> (cell spec, RNNCall)
_VALIDATED_MAX = 256


def array_keys(arrays) -> list | None:
    """Each array's (class, shape, dtype), None for None: what shape checks read of it; None where one is no
    NumPy or device array (lists, torch tensors: those take the full checks every time)."""
    key = []
    for a in arrays:
        if a is None:
            key.append(None)
        elif isinstance(a, np.ndarray) or is_device_array(a):
            key.append((type(a), a.shape, a.dtype))
        else:
            return None
    return key


def _signature(arrays, sequence_lengths, attrs) -> tuple | None:
    """Everything validate_forward's checks read, as a hashable key: each array's class, shape and dtype, the
    lengths' values, each attribute's type and value (True and 1 must not share an entry); None where some
    input has no such key (lists, torch tensors, device lengths: those take the full checks every time)."""
    key = array_keys(arrays)
    if key is None:
        return None
    if sequence_lengths is None:
        key.append(None)
    elif type(sequence_lengths) is np.ndarray:
        key.append((sequence_lengths.dtype, sequence_lengths.shape, sequence_lengths.tobytes()))
    else:
        return None
    key.extend((type(v), v) for v in attrs)
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


def validate_forward(input, input_h, input_c, params, sequence_lengths, *, rnn_mode, input_mode, direction,
                     dropout, seed, seed2, num_proj, is_training, time_major, num_layers=None, num_units=None,
                     zoneout=0.0):
    """Checks of CudnnRNNV3's inputs.  Returns (call, arrays) with arrays = dict of the checked arrays.

    `num_layers`/`num_units` are not op attributes in TF (they come from the params size and input_h);
    numbarnn infers them as TF does: L from input_h, H from input_c (LSTM) or input_h, unless given.
    The checks are a function of the arrays' classes, shapes and dtypes, the lengths and the attributes: a
    signature that passed once is not checked again (a loop of small calls paid ~60 us a call for them).
    """
    key = _signature((input, input_h, input_c, params), sequence_lengths,
                     (rnn_mode, input_mode, direction, dropout, seed, seed2, num_proj, is_training, time_major,
                      num_layers, num_units, zoneout))
    hit = _VALIDATED.get(key) if key is not None else None
    if hit is not None and hit[0] is registered_cell(hit[1].config.rnn_mode):   # (a cell replaced since: check again)
        call = hit[1]
        c0 = input_c if (call.config.has_cell_state or input_c is not None) else None
        return call, {"input": input, "input_h": input_h, "input_c": c0, "params": params}
    call, arrays = _validate_forward(input, input_h, input_c, params, sequence_lengths, rnn_mode=rnn_mode,
                                     input_mode=input_mode, direction=direction, dropout=dropout, seed=seed,
                                     seed2=seed2, num_proj=num_proj, is_training=is_training, time_major=time_major,
                                     num_layers=num_layers, num_units=num_units, zoneout=zoneout)
    if key is not None:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED[key] = (call.config.cell, call)
    return call, arrays


def _validate_forward(input, input_h, input_c, params, sequence_lengths, *, rnn_mode, input_mode, direction,
                      dropout, seed, seed2, num_proj, is_training, time_major, num_layers, num_units, zoneout=0.0):
    if not isinstance(time_major, (bool, np.bool_)):
        raise ArgumentTypeError(f"time_major: expected a bool, got {time_major!r}")
    if not isinstance(is_training, (bool, np.bool_)):
        raise ArgumentTypeError(f"is_training: expected a bool, got {is_training!r}")
    time_major, is_training = bool(time_major), bool(is_training)
    x = as_array("input", _typed("input", input))
    h0 = as_array("input_h", _typed("input_h", input_h))
    w = as_array("params", _typed("params", params))
    rnn_mode = check_choice("rnn_mode", rnn_mode, cell_names())
    is_lstm = get_cell(rnn_mode).cell_state      # the cell carries c: input_c is checked
    c0 = as_array("input_c", _typed("input_c", input_c) if is_lstm else input_c) \
        if (is_lstm or input_c is not None) else None
    dtype = check_same_dtype({"input": x, "input_h": h0, "params": w, **({"input_c": c0} if is_lstm else {})})
    reject_torch_tensor("sequence_lengths", sequence_lengths)

    legend_x = "[T, B, I]" if time_major else "[B, T, I]"
    xs = check_rank("input", x, 3, legend_x)
    T, B, I = (xs[0], xs[1], xs[2]) if time_major else (xs[1], xs[0], xs[2])
    hs = check_rank("input_h", h0, 3, "[L*D, B, P]" if time_major else "[B, L*D, P]")
    check_rank("params", w, 1, "(a 1-D opaque buffer)")
    LD_given, P_given = (hs[0], hs[2]) if time_major else (hs[1], hs[2])
    D = 2 if direction == "bidirectional" else 1

    if num_layers is None or num_units is None:
        if LD_given % D:
            raise ValueError(f"input_h: expected a first dimension L*D divisible by D={D} ({direction}), "
                             f"got shape {hs}")
        cs = check_rank("input_c", c0, 3, "[L*D, B, H]" if time_major else "[B, L*D, H]") if is_lstm else None
        L_inf, H_inf = _infer_layers_units(hs, cs, time_major, D, I, shape_of(w)[0], rnn_mode, input_mode,
                                           direction, num_proj)
        num_layers = L_inf if num_layers is None else num_layers
        num_units = H_inf if num_units is None else num_units
    cfg = rnn_config(num_layers, num_units, I, rnn_mode, input_mode, direction, num_proj, dropout, seed, seed2,
                     zoneout)
    batches = {"input_h": hs[1] if time_major else hs[0]}
    if is_lstm and len(shape_of(c0)) == 3:
        batches["input_c"] = shape_of(c0)[1] if time_major else shape_of(c0)[0]
    if sequence_lengths is not None and len(np.shape(sequence_lengths)) == 1:
        batches["sequence_lengths"] = np.shape(sequence_lengths)[0]
    _check_layout(batches, xs, time_major)
    lengths = _lengths(sequence_lengths, T, B)
    call = RNNCall(cfg, T, B, dtype, time_major, is_training, lengths)

    h_shape, c_shape = state_shapes(call)
    legend_h = "[L*D, B, P]" if time_major else "[B, L*D, P]"
    check_shape("input_h", h0, h_shape, legend_h)
    if is_lstm:
        check_shape("input_c", c0, c_shape, "[L*D, B, H]" if time_major else "[B, L*D, H]")
    n = params_size(cfg)
    if shape_of(w)[0] != n:
        raise ValueError(f"params: expected length params_size = {n} for this configuration (num_layers={cfg.L} "
                         f"and num_units={cfg.H} read from {'input_h and input_c' if is_lstm else 'input_h'}, "
                         f"input_size={cfg.I} read from input), got {shape_of(w)[0]}")
    return call, {"input": x, "input_h": h0, "input_c": c0, "params": w}


def _typed(name, a):
    """The op's float arrays must carry their dtype: a list or scalar would become float64 silently and then
    blame another argument's dtype, so it is rejected here, naming this argument."""
    if a is not None and not hasattr(a, "dtype") and not is_device_array(a):
        raise ArgumentTypeError(f"{name}: expected a NumPy array or a device array (float16, float32 or float64), "
                                f"got {type(a).__name__}; convert it with np.asarray({name}, dtype=...) in the dtype "
                                f"of the other arrays")
    return a


def _check_layout(batches: dict, xs, time_major) -> None:
    """Every batch size given (input_h, input_c, sequence_lengths) disagrees with input's B but equals input's
    other leading axis: input is in the other layout (say so instead of blaming input_h's shape)."""
    B, other = (xs[1], xs[0]) if time_major else (xs[0], xs[1])
    if B != other and all(b == other for b in batches.values()):
        name, batch = next(iter(batches.items()))

        legend, alt = ("[T, B, I]", "[B, T, I]") if time_major else ("[B, T, I]", "[T, B, I]")
        raise ValueError(f"input: shape {tuple(xs)} read as {legend} (time_major={time_major}) gives B={B}, but "
                         f"{name} has batch size {batch}, input's {'first' if time_major else 'second'} dimension: "
                         f"did you mean time_major={not time_major}? (then input is {alt} and the states are "
                         f"{'[B, L*D, P]' if time_major else '[L*D, B, P]'})")


def _infer_layers_units(hs, cs, time_major, D, I, n_params, rnn_mode, input_mode, direction, num_proj):

    """(L, H) as TF reads them: L from input_h's L*D, H from input_c (LSTM) or input_h (other modes).

    For an LSTM, input_h and input_c both carry L*D, and without projection both carry H.  When they disagree,
    the reading whose params_size matches the params length wins, so that the shape check that follows names
    the state that is off rather than the other one.  Without any match TF's reading is kept.
    """
    LD_h, P_h = (hs[0], hs[2]) if time_major else (hs[1], hs[2])
    if cs is None:
        return LD_h // D, P_h
    LD_c, H_c = (cs[0], cs[2]) if time_major else (cs[1], cs[2])
    candidates = [(LD_h // D, H_c)]
    if LD_c % D == 0:
        candidates.append((LD_c // D, H_c))
    if not num_proj:   # no projection: P = H, so input_h carries H too
        candidates += [(LD_h // D, P_h)] + ([(LD_c // D, P_h)] if LD_c % D == 0 else [])
    for L, H in candidates:
        try:
            if params_size(rnn_config(L, H, I, rnn_mode, input_mode, direction, num_proj)) == n_params:
                return L, H
        except (ValueError, TypeError):
            continue
    return candidates[0]


# ---------------------------------------------------------------------------------------------------
# host_reserved: a fingerprint of the forward call (SPEC 7, choice)
# ---------------------------------------------------------------------------------------------------
_MAGIC = b"NRNN1"


def encode_host_reserved(call: RNNCall, reserve_size: int, nonce=None) -> np.ndarray:
    """int8 1-D: magic, then the JSON of the fingerprint, reserve size and the nonce written into the reserve
    (`numbarnn.reserve`; readable with `decode_host_reserved`)."""
    return np.frombuffer(_encoded(call, int(reserve_size), None if nonce is None else tuple(int(v) for v in nonce)),
                         dtype=np.int8).copy()


@functools.lru_cache(maxsize=64)
def _encoded(call: RNNCall, reserve_size: int, nonce: tuple | None) -> bytes:
    """host_reserved's bytes (a call with a fixed nonce, numbarnn.torch's, encodes the same bytes every time)."""
    extra = {} if nonce is None else {"nonce": list(nonce)}
    payload = json.dumps({**call.fingerprint(), "reserve_size": reserve_size, **extra}, sort_keys=True).encode()
    return _MAGIC + hashlib.sha256(payload).digest()[:8] + payload


def decode_host_reserved(host_reserved) -> dict:
    reject_torch_tensor("host_reserved", host_reserved)
    a = np.asarray(host_reserved)
    if a.ndim != 1 or a.dtype != np.int8:
        raise ValueError(f"host_reserved: expected the int8 1-D array returned by the forward call, got dtype "
                         f"{a.dtype} with shape {a.shape}")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in _decode(a.tobytes())}   # fresh lists


@functools.lru_cache(maxsize=64)
def _decode(raw: bytes) -> tuple:
    """The fingerprint in host_reserved's bytes, as (key, value) pairs (a backward of numbarnn.torch's operator
    passes the same bytes at every call: decoded once); JSON lists kept as tuples, so the cached value cannot
    be changed by a caller."""
    if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + 8:
        raise ValueError("host_reserved: not produced by a numbarnn forward call with is_training=True")
    digest, payload = raw[len(_MAGIC):len(_MAGIC) + 8], raw[len(_MAGIC) + 8:]
    if hashlib.sha256(payload).digest()[:8] != digest:
        raise ValueError("host_reserved: corrupted (checksum mismatch)")
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in json.loads(payload).items())


@functools.lru_cache(maxsize=64)
def _recorded_nonce(raw: bytes) -> list:
    """The nonce host_reserved's bytes record, as `read_nonce` gives a reserve's (floats; compared, never
    written)."""
    return [float(v) for v in dict(_decode(raw)).get("nonce", ())]


def check_host_reserved(call: RNNCall, host_reserved, reserve_space, expected_reserve_size: int) -> None:
    """Backprop's arguments must describe the same call as the forward that produced the reserve."""
    if host_reserved is None:
        raise ValueError("host_reserved: expected the host_reserved returned by the training forward call, got None")
    if reserve_space is None:
        raise ValueError("reserve_space: expected the reserve_space returned by the training forward call, got None")
    recorded = decode_host_reserved(host_reserved)
    mine = {**call.fingerprint(), "reserve_size": int(expected_reserve_size)}
    for key in ("zoneout", "zoneout_seed", "zoneout_seed2"):   # (recorded only with zoneout: either side may lack it)
        mine.setdefault(key, recorded.get(key) if key != "zoneout" else 0.0)
        recorded.setdefault("zoneout", 0.0)
    for key, value in mine.items():
        if key == "reserve_size":
            continue
        if recorded.get(key) != value:
            raise ValueError(f"host_reserved: the forward call had {key}={recorded.get(key)!r} but backprop was "
                             f"given {key}={value!r}")
    rs = shape_of(reserve_space)
    if len(rs) != 1 or rs[0] != expected_reserve_size or recorded.get("reserve_size") != expected_reserve_size:
        raise ValueError(f"reserve_space: expected a 1-D buffer of {expected_reserve_size} elements (from the "
                         f"forward call with is_training=True), got shape {rs}")


def check_reserve_nonce(host_reserved, reserve_space) -> None:
    """The reserve must come from the same forward call as host_reserved: both carry that call's random nonce."""
    if type(host_reserved) is np.ndarray and host_reserved.dtype == np.int8 and host_reserved.ndim == 1:
        expected = _recorded_nonce(host_reserved.tobytes())      # (decoded once per host_reserved's bytes)
        got = read_nonce(reserve_space)
        if got == expected:
            return
    recorded = decode_host_reserved(host_reserved)

    got = read_nonce(reserve_space)
    if got != [float(v) for v in recorded.get("nonce", ())]:
        raise ValueError(f"reserve_space and host_reserved come from different forward calls: host_reserved records "
                         f"the nonce {recorded.get('nonce')} but reserve_space holds {[int(v) for v in got]}; pass the "
                         f"reserve_space and host_reserved returned by the same cudnn_rnn_v3 call")



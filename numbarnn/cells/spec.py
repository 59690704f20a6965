"""`CellSpec`: the one declarative description of a recurrent cell, and the registry of cells.

Everything that differs between cells is derived from a spec (as PyTorch's RNNBase derives it from the
mode): the gate count G and gate names (so the params layout, the canonical lists and the converters),
whether a cell state c is carried, the per-unit parameter vectors V (e.g. peepholes), what is saved for
backward S (so the reserve layout), whether a projection is allowed, the kind of recurrence, and the pointwise math.

The recurrence is a matrix product per gate (``recurrence="matrix"``: rh_g = R_g h + bR_g, R_g [H, P], cuDNN's
cells) or a per-unit scale (``recurrence="diagonal"``: rh_g = u_g ⊙ h + bR_g, u_g [H], IndRNN): a diagonal cell
has a vector where the params hold R_g, no recurrent product in the kernels, and no projection (u_g scales the
unit's own h).  The pointwise functions are the same for both: the framework computes rh and turns drh into
du_g = sum over t, b of drh_g * h and dh += drh_g * u_g.

The pointwise functions are plain scalar Python, one hidden unit j of one batch row at one step; the
network around them (input GEMM, recurrent product, lengths, directions, layers, dropout, projection) is the
framework's.  The kernel templates compile them as CUDA device functions; the reference backend runs them
as they are (for user cells: the built-in cells keep their hand-written NumPy oracle).

    forward(wx, rh, v, h, c, saved) -> (m, c_new)
        wx[g]    W_g x + bW_g            G values: the input side of every gate (x already projected)
        rh[g]    R_g h + bR_g            G values: the recurrent side, kept apart so a cell may use it
                                         separately (GRU: n = tanh(wx_n + r * rh_n))
        v[k]     cell vector k at j      V values (peephole weights, ...)
        h        h_prev[j]               this unit's previous output (0 with a projection: cells that allow
                                         one must not read it)
        c        c_prev[j]               the previous cell state (0 without one)
        saved    out: S values           what backward needs, in the order of `saved`
        returns m, the unit's output (h', or the projection's input), and c' (any value without a state)

    backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv) -> (dh, dc_prev)
        dm       dL/dm                   the gradient reaching the unit's output
        dc       dL/dc'                  from the next step (0 without a state)
        saved    the forward's saved values ; v, h, c as in forward ; c_new = c'
        dwx[g]   out: dL/d(wx_g)         also dL/d(bW_g)
        drh[g]   out: dL/d(rh_g)         read only for the gates named in `split_recurrent`; for every other
                                         gate dL/d(rh_g) = dL/d(wx_g) (the gate saw wx_g + rh_g)
        dv[k]    out: dL/d(v_k)          this step's contribution (summed over steps and rows by the driver)
        returns dL/dh (the part that bypasses R: GRU's z*dm; 0 for most cells) and dL/dc (0 without a state)

A cell may modulate the state before some gates' recurrent product (``modulated``: the classic GRU's reset
gate, n = tanh(W_n x + R_n (r ⊙ h)); the MGU's forget gate).  A step then makes two recurrent products, in order:
the unmodulated gates' rh_g = R_g h + bR_g, the modulation m of each unit from them, and the modulated gates'
rh_g = R_g (m ⊙ h) + bR_g; then `forward` sees every rh as above.  Two more pointwise functions, per unit j:

    modulation(wx, rh, v, h) -> m        m, the unit's modulation (reads wx, rh of the unmodulated gates only:
                                         the modulated gates' rh are 0 when it runs)
    modulation_backward(dmod, mod, saved, v, h, dwx, drh)
        dmod     dL/dm                   the framework's: (sum over the modulated gates of R_g^T drh_g)_j * h
        mod      m                       as `modulation` returned it (saved by the framework, per step)
        saved    forward's saved values ; v, h as in forward
        dwx[g]   out: dL/d(wx_g)         through m only, for the unmodulated gates (the framework adds them to
        drh[g]   out: dL/d(rh_g)         backward's own; drh read for `split_recurrent` gates only, as above)
`backward` gives the gradients through the cell's own output (its drh of a modulated gate is dL/d(R_g (m ⊙ h));
the framework turns it into dR_g = sum of drh_g (m ⊙ h)^T, dL/dh += m ⊙ R_g^T drh_g and dmod).  The framework
saves m per step (the reserve's mod_l).  A modulated cell has a matrix recurrence and no projection (m ⊙ h needs
the unit's own h).

A cell may layer-normalise (``layer_norm``, a subset of NORMALISED: haste's LayerNormLSTM / LayerNormGRU) the row's
input products W x ("wx"), its recurrent products R h ("rh"), each across all G*H values of one batch row with a
gain γ [G*H] and then the usual bias, and its new cell state ("c") across the row's H units with a gain and a bias
(SPEC 13).  The framework does the row reductions; the pointwise functions see wx, rh as above.  With "c" the
state is carried unnormalised, and the unit's output comes from the normalised n by two more functions:

    output(n, saved, v) -> m             m from n = LN(c')_j (forward's own m is not used: return 0.0)
    output_backward(dm, n, saved, v, dwx, drh) -> dn
        dwx[g], drh[g]   out: dL/d(wx_g), dL/d(rh_g) through m (drh read for `split_recurrent` gates only)
        returns dL/dn
The framework adds LN's backward of dn to dL/dc' and calls `backward` with dm = 0; the two dwx (drh) are summed.
The normalisation gains and biases are per pseudo-layer vectors [H] at the end of the params (`norm_vectors`).

Register a spec with `register(spec)`; afterwards `rnn_mode=spec.name` works in every op, layer and tool.
"""
from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

#: the kinds of recurrence a cell may declare (CellSpec.recurrence)
RECURRENCES = ("matrix", "diagonal")
_FORWARD_ARGS = ("wx", "rh", "v", "h", "c", "saved")
_BACKWARD_ARGS = ("dm", "dc", "saved", "v", "h", "c", "c_new", "dwx", "drh", "dv")
_MODULATION_ARGS = ("wx", "rh", "v", "h")
_MODULATION_BACKWARD_ARGS = ("dmod", "mod", "saved", "v", "h", "dwx", "drh")
#: what a cell may layer-normalise (CellSpec.layer_norm): W x, R h (across the row's G*H), the cell state (H)
NORMALISED = ("wx", "rh", "c")
_OUTPUT_ARGS = ("n", "saved", "v")
_OUTPUT_BACKWARD_ARGS = ("dm", "n", "saved", "v", "dwx", "drh")


@dataclass(frozen=True)
class CellSpec:
    """A recurrent cell, declaratively.  Letters: G gates, S saved values, V cell vectors (all per unit)."""

    name: str                                   # the rnn_mode string, e.g. "lstm"
    gates: tuple                                # gate names in parameter order (cuDNN linear-layer ids 0..G-1)
    saved: tuple                                # names of the S values `forward` saves for `backward`
    forward: Callable = field(repr=False)       # pointwise forward, see the module docstring
    backward: Callable = field(repr=False)      # pointwise backward
    cell_state: bool = False                    # carries c (input_c / output_c, saved c' per step)
    vectors: tuple = ()                         # per-unit parameter vectors [H] each, e.g. peepholes
    split_recurrent: tuple = ()                 # gates whose R side gets its own gradient (drh)
    projection: bool = False                    # num_proj allowed (needs a cell state; h is never read)
    equations: str = ""                         # shown by `numbarnn explain` and the docs
    recurrence: str = "matrix"                  # "matrix" (R_g h) or "diagonal" (u_g ⊙ h, IndRNN)
    modulated: tuple = ()                       # gates whose recurrent input is R_g (m ⊙ h) (classic GRU: n)
    modulation: Callable | None = field(default=None, repr=False)            # m from the other gates, per unit
    modulation_backward: Callable | None = field(default=None, repr=False)   # dL/dm into their dwx, drh
    layer_norm: tuple = ()                      # layer-normalised across the row: "wx", "rh", "c" (SPEC 13)
    output: Callable | None = field(default=None, repr=False)                # "c": m from the normalised state
    output_backward: Callable | None = field(default=None, repr=False)       # "c": dL/dm into dL/dn, dwx, drh

    def __post_init__(self):
        for attr in ("gates", "saved", "vectors", "split_recurrent", "modulated", "layer_norm"):
            value = getattr(self, attr)
            if isinstance(value, str) or not all(isinstance(n, str) and n for n in value):
                raise TypeError(f"CellSpec.{attr}: expected a tuple of non-empty names, got {value!r}")
            object.__setattr__(self, attr, tuple(value))
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"CellSpec.name: expected an identifier such as 'peephole_lstm', got {self.name!r}")
        if not self.gates:
            raise ValueError(f"CellSpec.gates: a cell needs at least one gate, got {self.gates!r}")
        if not self.saved:
            raise ValueError("CellSpec.saved: expected at least one saved value (backward reads them)")
        for attr, names in (("gates", self.gates), ("saved", self.saved), ("vectors", self.vectors)):
            if len(set(names)) != len(names):
                raise ValueError(f"CellSpec.{attr}: names must be distinct, got {names!r}")
        unknown = [g for g in self.split_recurrent if g not in self.gates]
        if unknown:
            raise ValueError(f"CellSpec.split_recurrent: {unknown} are not gates of {self.name!r} {self.gates}")
        if self.recurrence not in RECURRENCES:
            raise ValueError(f"CellSpec.recurrence: expected one of {RECURRENCES}, got {self.recurrence!r}")
        if self.recurrence == "diagonal" and self.projection:
            raise ValueError("CellSpec.recurrence: a diagonal recurrence (u_g ⊙ h) cannot have a projection "
                             "(projection=True): u_g scales the unit's own h, which a projection replaces")
        self._check_modulation()
        self._check_layer_norm()
        self._check_layer_norm_combinations()
        if self.projection and not self.cell_state:
            raise ValueError("CellSpec.projection: a projection needs a cell state (h' = W_proj m feeds only R)")
        for attr, expected in (("forward", _FORWARD_ARGS), ("backward", _BACKWARD_ARGS)):
            _check_function(f"CellSpec.{attr}", getattr(self, attr), expected)

    def _check_modulation(self):
        """Modulated gates: known, distinct, not all of them; both functions; a matrix recurrence; no projection."""
        has_fn = (self.modulation is not None, self.modulation_backward is not None)
        if not self.modulated:
            if any(has_fn):
                raise ValueError("CellSpec.modulated: modulation / modulation_backward are given but no gate is "
                                 "modulated (name the gates whose recurrent input is R_g (m ⊙ h))")
            return
        unknown = [g for g in self.modulated if g not in self.gates]
        if unknown:
            raise ValueError(f"CellSpec.modulated: {unknown} are not gates of {self.name!r} {self.gates}")
        if len(set(self.modulated)) != len(self.modulated):
            raise ValueError(f"CellSpec.modulated: names must be distinct, got {self.modulated!r}")
        if len(self.modulated) == len(self.gates):
            raise ValueError(f"CellSpec.modulated: at least one gate must stay unmodulated (m is computed from "
                             f"them), got every gate {self.modulated!r}")
        if self.recurrence != "matrix":
            raise ValueError(f"CellSpec.modulated: a modulated state (R_g (m ⊙ h)) needs recurrence='matrix', "
                             f"got {self.recurrence!r}")
        if self.projection:
            raise ValueError("CellSpec.modulated: a modulated cell cannot have a projection (projection=True): "
                             "m ⊙ h needs the unit's own h, which a projection replaces")
        for attr, expected in (("modulation", _MODULATION_ARGS), ("modulation_backward", _MODULATION_BACKWARD_ARGS)):
            if getattr(self, attr) is None:
                raise TypeError(f"CellSpec.{attr}: a cell with modulated gates {self.modulated} needs a plain "
                                f"Python function of ({', '.join(expected)}), got None")
            _check_function(f"CellSpec.{attr}", getattr(self, attr), expected)

    def _check_layer_norm(self):
        """Known, distinct names; "c" needs a cell state and both output functions; a matrix recurrence without
        modulation or projection."""
        has_fn = (self.output is not None, self.output_backward is not None)
        unknown = [n for n in self.layer_norm if n not in NORMALISED]
        if unknown:
            raise ValueError(f"CellSpec.layer_norm: {unknown} cannot be normalised; expected names from "
                             f"{NORMALISED} (W x, R h, the cell state), got {self.layer_norm!r}")
        if len(set(self.layer_norm)) != len(self.layer_norm):
            raise ValueError(f"CellSpec.layer_norm: names must be distinct, got {self.layer_norm!r}")
        if "c" not in self.layer_norm:
            if any(has_fn):
                raise ValueError("CellSpec.output: output / output_backward are given but the cell state is not "
                                 "normalised (add 'c' to layer_norm)")
            return
        if not self.cell_state:
            raise ValueError("CellSpec.layer_norm: 'c' normalises the cell state, but the cell has none "
                             "(cell_state=False)")
        for attr, expected in (("output", _OUTPUT_ARGS), ("output_backward", _OUTPUT_BACKWARD_ARGS)):
            if getattr(self, attr) is None:
                raise TypeError(f"CellSpec.{attr}: a cell with a normalised state (layer_norm has 'c') needs a "
                                f"plain Python function of ({', '.join(expected)}), got None")
            _check_function(f"CellSpec.{attr}", getattr(self, attr), expected)

    def _check_layer_norm_combinations(self):
        if not self.layer_norm:
            return
        if self.recurrence != "matrix":
            raise ValueError(f"CellSpec.layer_norm: a layer-normalised cell needs recurrence='matrix', got "
                             f"{self.recurrence!r}")
        if self.modulated:
            raise ValueError(f"CellSpec.layer_norm: a layer-normalised cell cannot also be modulated "
                             f"(modulated={self.modulated!r})")
        if self.projection:
            raise ValueError("CellSpec.layer_norm: a layer-normalised cell cannot have a projection "
                             "(projection=True)")

    # derived sizes ------------------------------------------------------------------------------
    @property
    def G(self) -> int:
        return len(self.gates)

    @property
    def S(self) -> int:
        return len(self.saved)

    @property
    def V(self) -> int:
        return len(self.vectors)

    @property
    def split_mask(self) -> tuple:
        """Per gate: True where the R side has its own gradient."""
        return tuple(g in self.split_recurrent for g in self.gates)

    @property
    def diagonal(self) -> bool:
        """The recurrent weight of each gate is a vector u_g [H] (rh_g = u_g ⊙ h + bR_g), not a matrix."""
        return self.recurrence == "diagonal"

    @property
    def modulated_mask(self) -> tuple:
        """Per gate: True where the recurrent input is the modulated state m ⊙ h."""
        return tuple(g in self.modulated for g in self.gates)

    @property
    def norm_groups(self) -> tuple:
        """(name, count) of the normalisation vectors [H] each, in params order: ln_wx_gain (G) with "wx",
        ln_rh_gain (G) with "rh", ln_c_gain and ln_c_bias (1 each) with "c"."""
        G, groups = len(self.gates), []
        if "wx" in self.layer_norm:
            groups.append(("ln_wx_gain", G))
        if "rh" in self.layer_norm:
            groups.append(("ln_rh_gain", G))
        if "c" in self.layer_norm:
            groups += [("ln_c_gain", 1), ("ln_c_bias", 1)]
        return tuple(groups)

    @property
    def NV(self) -> int:
        """Normalisation vectors [H] per pseudo-layer (0 without layer_norm)."""
        return sum(count for _, count in self.norm_groups)

    def gate(self, name: str) -> int:
        """Index of a gate by name (the named gate offsets of the kernels and cells)."""
        return self.gates.index(name)


def _check_function(what: str, fn, expected: tuple) -> None:
    """`fn` is a plain Python function of len(expected) positional arguments (TypeError naming `what`)."""
    if not inspect.isfunction(fn):
        raise TypeError(f"{what}: expected a plain Python function, got {fn!r}")
    params = [p for p in inspect.signature(fn).parameters.values()]
    if len(params) != len(expected) or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                           for p in params):
        raise TypeError(f"{what}: expected a function of {len(expected)} positional arguments "
                        f"({', '.join(expected)}), got {fn.__name__}{inspect.signature(fn)}")


_CELLS: dict[str, CellSpec] = {}


def register(spec: CellSpec, *, replace: bool = False) -> CellSpec:
    """Make `spec.name` a valid rnn_mode everywhere.  Re-registering the same name needs replace=True
    (a module imported twice registers an equal spec again, which is accepted)."""
    if not isinstance(spec, CellSpec):
        raise TypeError(f"spec: expected a numbarnn.cells.CellSpec, got {type(spec).__name__}")
    old = _CELLS.get(spec.name)
    if old is not None and not replace and not _same(old, spec):
        raise ValueError(f"spec: a different cell named {spec.name!r} is already registered "
                         f"(pass replace=True to replace it)")
    _CELLS[spec.name] = spec
    return spec


def _same(a: CellSpec, b: CellSpec) -> bool:
    """Equal cells: the same fields and functions of the same code reading the same globals (a module imported
    again, also under another module name: `--cells path.py` beside the user's own `import`, a notebook's reload,
    the same definition run again in another notebook cell)."""
    return a == b or (a.name == b.name and a.gates == b.gates and a.saved == b.saved
                      and a.cell_state == b.cell_state and a.vectors == b.vectors
                      and a.split_recurrent == b.split_recurrent and a.projection == b.projection
                      and a.recurrence == b.recurrence and a.modulated == b.modulated
                      and a.layer_norm == b.layer_norm
                      and _code(a.forward) == _code(b.forward) and _code(a.backward) == _code(b.backward)
                      and all((f is None) == (g is None) and (f is None or _code(f) == _code(g))
                              for f, g in ((a.modulation, b.modulation),
                                           (a.modulation_backward, b.modulation_backward),
                                           (a.output, b.output), (a.output_backward, b.output_backward))))


def _code(fn, depth: int = 0):
    """What a pointwise function computes, comparable across re-imports: its bytecode and constants, and what each
    global name and closure variable it reads stands for (a number by value, a function by its own `_code`, a
    module or anything else by identity).  Not the file name: re-running a definition elsewhere is the same cell."""
    def meaning(value):
        if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
            return (type(value).__name__, value)
        if inspect.isfunction(value) and depth < 4:
            return _code(value, depth + 1)
        if isinstance(value, tuple):
            return tuple(meaning(v) for v in value)
        return ("id", id(value))

    code = fn.__code__
    names = tuple((name, meaning(fn.__globals__.get(name, getattr(builtins, name, _UNBOUND))))
                  for name in code.co_names)         # attribute names too: then both sides read _UNBOUND
    cells = tuple(meaning(_contents(cell)) for cell in (fn.__closure__ or ()))
    return code.co_code, code.co_consts, fn.__qualname__, names, cells


_UNBOUND = object()          # a name that is neither a global nor a builtin (an attribute: `math.exp`'s exp)


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:       # a closure variable not yet assigned
        return _UNBOUND


def get_cell(name: str) -> CellSpec:
    """The registered spec of an rnn_mode (ValueError naming rnn_mode when unknown)."""
    try:
        return _CELLS[name]
    except (KeyError, TypeError):
        raise ValueError(f"rnn_mode: expected one of {cell_names()} (or a cell registered with "
                         f"numbarnn.cells.register), got {name!r}") from None


def registered_cell(name) -> CellSpec | None:
    """The spec registered under `name` now, or None (no error: for caches that check a name still means the
    same cell)."""
    return _CELLS.get(name) if isinstance(name, str) else None


def cell_names() -> tuple:
    """Every registered rnn_mode, built-in first."""
    return tuple(_CELLS)


def is_builtin(name: str) -> bool:
    return name in BUILTIN


def load_cell_modules(names, what: str = "--cells") -> None:
    """Import each module name or .py file in `names` (they register their cells on import); a file already
    loaded is not run again.  `what` names the argument in errors (ValueError)."""
    for name in names or ():
        if name.endswith(".py") or os.sep in name:
            if not os.path.isfile(name):
                raise ValueError(f"{what}: no such file {name!r}")
            module_name = "numbarnn_user_cells_" + os.path.splitext(os.path.basename(name))[0]
            if module_name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(module_name, name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ValueError(f"{what}: cannot import {name!r} ({exc})") from None


#: the cuDNN cells, registered by numbarnn.cells at import
BUILTIN = ("lstm", "gru", "rnn_tanh", "rnn_relu")

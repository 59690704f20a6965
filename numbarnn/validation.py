"""Small argument checks shared by every op (SPEC section 11).

Every check raises a ``ValueError`` (``TypeError`` for dtypes) whose message names the argument,
says what was expected and what came.  The checks only read ``.shape`` / ``.dtype``, so they work
the same on NumPy arrays and on device arrays (anything with ``__cuda_array_interface__``).
"""
from __future__ import annotations

import numbers

import numpy as np

class ArgumentTypeError(TypeError, ValueError):
    """A wrong type or dtype of an argument.

    Both a TypeError (it is one) and a ValueError (SPEC 11: every bad input is a ValueError naming the
    argument), like NumPy's AxisError, so callers catching either see it.
    """


#: dtypes every op accepts; half is stored as half and computed in float32 (float64 in the reference)
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_device_array(a) -> bool:
    """True for numba device arrays (also the simulator's), CuPy arrays, ... (not NumPy; torch tensors are refused
    before this is asked, see `reject_torch_tensor`)."""
    if isinstance(a, np.ndarray):
        return False
    return hasattr(a, "__cuda_array_interface__") or bool(getattr(a, "__cuda_ndarray__", False))


def is_torch_tensor(a) -> bool:
    """True for a torch.Tensor or a subclass (nn.Parameter, ...), told by its classes so torch is never imported."""
    return any(c.__name__ == "Tensor" and c.__module__.split(".")[0] == "torch" for c in type(a).__mro__)


def reject_torch_tensor(name: str, a) -> None:
    """One rule for tensors: the ops take NumPy (or device) arrays, never a torch.Tensor.

    Converting one here would silently detach it from autograd (and fails once it requires grad), so the
    error points to the modules that do handle tensors and autograd, or to the explicit conversion.
    """
    if is_torch_tensor(a):
        raise ArgumentTypeError(f"{name}: got a torch.Tensor; numbarnn.ops (and numbarnn's layers) take NumPy arrays "
                                f"(or numba device arrays): use numbarnn.torch's modules (LSTM, GRU, RNN) for tensors "
                                f"and autograd, or pass t.detach().cpu().numpy()")


def as_array(name: str, a):
    """Host inputs become NumPy arrays; device arrays pass through untouched; torch tensors are refused."""
    if type(a) is np.ndarray:                    # (the common case first: a NumPy array is never a tensor)
        return a
    if a is None:
        raise ValueError(f"{name}: expected an array, got None")
    reject_torch_tensor(name, a)
    if is_device_array(a) or isinstance(a, np.ndarray):
        return a
    try:
        return np.asarray(a)
    except Exception as exc:  # pragma: no cover - exotic objects
        raise ArgumentTypeError(f"{name}: expected an array, got {type(a).__name__}") from exc


def shape_of(a) -> tuple:
    return tuple(int(s) for s in a.shape)


def dtype_of(name: str, a) -> np.dtype:
    dt = np.dtype(a.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(f"{name}: expected dtype float16, float32 or float64, got {dt}")
    return dt


def check_same_dtype(named: dict) -> np.dtype:
    """All arrays float16/32/64 and one dtype; returns it."""
    dtypes = {name: dtype_of(name, a) for name, a in named.items() if a is not None}
    first_name, first = next(iter(dtypes.items()))
    for name, dt in dtypes.items():
        if dt != first:
            raise ArgumentTypeError(f"{name}: expected dtype {first} (the dtype of {first_name}), got {dt}")
    return first


def _fmt(expected, legend) -> str:
    shape = "(" + ", ".join(str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
    return f"{legend} = {shape}" if legend else shape


def check_shape(name: str, a, expected: tuple, legend: str = "") -> None:
    """Rank first (so a `[1,1,1]` in place of a matrix reads as a rank error), then every dimension."""
    got = shape_of(a)
    if len(got) != len(expected):
        raise ValueError(f"{name}: expected rank {len(expected)} with shape {_fmt(expected, legend)}, "
                         f"got rank {len(got)} with shape {got}")
    if got != tuple(expected):
        raise ValueError(f"{name}: expected shape {_fmt(expected, legend)}, got {got}")


def check_rank(name: str, a, rank: int, legend: str = "") -> tuple:
    got = shape_of(a)
    if len(got) != rank:
        what = f" {legend}" if legend else ""
        raise ValueError(f"{name}: expected rank {rank}{what}, got rank {len(got)} with shape {got}")
    return got


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python/NumPy integer (not bool, not float) within [minimum, maximum]."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an integer <= {maximum}, got {value}")
    return value


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_float(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number in [{lo}, {hi}], got {value!r}")
    value = float(value)
    if not (lo <= value <= hi):  # also rejects NaN
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}], got {value}")
    return value

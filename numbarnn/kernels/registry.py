"""Registry of every kernel specialisation, so that the kernel report (numbarnn.analysis.report) can compile them
all for real GPUs.

How a kernel module takes part (pick one; nothing here compiles anything):

1. Module-level specs (preferred).  A module of ``numbarnn.kernels`` (found automatically) or one named in
   ``KERNEL_MODULES`` below defines either

       KERNEL_SPECS = [(name, pyfunc, signature), ...]           # a list, or
       def kernel_specs(): return [(name, dtype, pyfunc, signature, block), ...]   # a function

   Each item is a ``KernelSpec`` or a tuple ``(name, pyfunc, signature)``, ``(name, dtype, pyfunc,
   signature)`` or ``(name, dtype, pyfunc, signature, block)``:
     name       kernel name as the report prints it (unique together with dtype), e.g. "gemm_v3_nt"
     dtype      "float32", ...; when left out, the dtype of the first array argument of the signature
     pyfunc     the plain Python function that the factory wraps with ``cuda.jit`` (a ``cuda.jit``
                dispatcher is accepted too: its ``py_func`` is used)
     signature  numba argument types: a tuple of numba types or a string like "void(float32[:, ::1], int64)"
     block      threads per block at launch, for the occupancy column (None: the report's --block)
   Building the specs must stay cheap (closures only, no compilation): the report imports every module.

2. ``register(name, dtype, pyfunc, signature, block=None)`` at import time of the module, for code outside
   ``numbarnn.kernels`` that the report would not import otherwise (then list the module in
   ``KERNEL_MODULES`` too, or import it before calling ``all_specs``).

``KERNEL_MODULES`` lists modules by name; a listed module that does not exist (yet) is skipped.  Every
submodule of ``numbarnn.kernels`` is imported as well (except this registry), so a new
kernel module needs no edit here.  A module that exists but fails to import, or yields a malformed
spec, is reported as a problem (the report then exits 1): it is never silently skipped.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import numbarnn.kernels as package

#: modules asked for ``kernel_specs()`` / ``KERNEL_SPECS``; missing ones are skipped
KERNEL_MODULES = (
    "numbarnn.kernels.gemm",
    "numbarnn.kernels.philox",
    "numbarnn.kernels.cell_steps",
    "numbarnn.kernels.step_v2",
    "numbarnn.kernels.step_v3",
    "numbarnn.kernels.block_lstm",
)

#: submodules of numbarnn.kernels that are not kernel modules
_NOT_KERNEL_MODULES = {"numbarnn.kernels.registry"}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    dtype: str
    pyfunc: Callable
    signature: Any              # tuple of numba types or signature string
    block: int | None = None    # threads per block at launch
    module: str = field(default="", compare=False)


class RegistryError(Exception):
    """A kernel module failed to import or gave a malformed spec."""


_REGISTERED: list[KernelSpec] = []


def register(name: str, dtype: str | None, pyfunc, signature, block: int | None = None) -> KernelSpec:
    """Declare one compile-time specialisation (call at import time; compiles nothing)."""
    caller = inspect.currentframe().f_back
    module = caller.f_globals.get("__name__", "") if caller is not None else ""
    spec = _make_spec((name, dtype, pyfunc, signature, block), module)
    _REGISTERED.append(spec)
    return spec


def _first_array_dtype(signature) -> str:
    from numba import types  # lazy: numba after the simulator switch
    from numba.core import sigutils  # lazy: numba after the simulator switch

    try:
        args, _ = sigutils.normalize_signature(signature)
    except Exception:
        return "-"
    for t in args:
        if isinstance(t, types.Array):
            return str(t.dtype)
    for t in args:
        if isinstance(t, types.Float):
            return str(t)
    return "-"


def _make_spec(item, module: str) -> KernelSpec:
    if isinstance(item, KernelSpec):
        return item if item.module else KernelSpec(item.name, item.dtype, item.pyfunc, item.signature,
                                                   item.block, module)
    if isinstance(item, dict):
        item = (item["name"], item.get("dtype"), item["pyfunc"], item["signature"], item.get("block"))
    if not isinstance(item, (tuple, list)) or len(item) not in (3, 4, 5):
        raise RegistryError(f"{module}: a kernel spec must be (name, pyfunc, signature), (name, dtype, pyfunc, "
                            f"signature) or (name, dtype, pyfunc, signature, block), got {item!r}")
    if len(item) == 3:
        name, pyfunc, signature = item
        dtype, block = None, None
    else:
        name, dtype, pyfunc, signature = item[:4]
        block = item[4] if len(item) == 5 else None
    pyfunc = getattr(pyfunc, "py_func", pyfunc)  # a cuda.jit dispatcher -> its Python function
    if not isinstance(name, str) or not name:
        raise RegistryError(f"{module}: kernel name must be a non-empty string, got {name!r}")
    if not callable(pyfunc):
        raise RegistryError(f"{module}: {name}: pyfunc must be a Python function, got {pyfunc!r}")
    if block is not None and (not isinstance(block, int) or block <= 0):
        raise RegistryError(f"{module}: {name}: block must be a positive int (threads per block), got {block!r}")
    if dtype is None:
        dtype = _first_array_dtype(signature)
    return KernelSpec(name, str(dtype), pyfunc, signature, block, module)


def kernel_module_names() -> list[str]:
    """KERNEL_MODULES that exist, then every other submodule of numbarnn.kernels."""
    names = []
    for name in KERNEL_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # parent package missing
            found = False
        if found:
            names.append(name)
    for info in pkgutil.iter_modules(package.__path__, prefix="numbarnn.kernels."):
        if info.name not in names and info.name not in _NOT_KERNEL_MODULES:
            names.append(info.name)
    return names


def load_specs() -> tuple[list[KernelSpec], list[str]]:
    """(specs, problems): every spec that could be loaded, and one line per module or spec that could not."""
    specs: list[KernelSpec] = []
    problems: list[str] = []
    for module_name in kernel_module_names():
        try:
            module = importlib.import_module(module_name)
            if hasattr(module, "kernel_specs"):
                items = list(module.kernel_specs())
            else:
                items = list(getattr(module, "KERNEL_SPECS", ()))
        except Exception as exc:  # a broken module is a finding, not a reason to stop
            problems.append(f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        for item in items:
            try:
                specs.append(_make_spec(item, module_name))
            except Exception as exc:
                problems.append(f"{module_name}: {exc}")
    specs.extend(_REGISTERED)  # after the imports above, which may register
    unique: dict[tuple, KernelSpec] = {}
    for spec in specs:
        key = (spec.name, spec.dtype)
        if key in unique:
            if unique[key].pyfunc is not spec.pyfunc or str(unique[key].signature) != str(spec.signature):
                problems.append(f"{spec.module}: kernel {spec.name} ({spec.dtype}) declared twice "
                                f"(also by {unique[key].module}) with different code or signature")
            continue
        unique[key] = spec
    return list(unique.values()), problems


def all_specs() -> list[KernelSpec]:
    """Every registered specialisation; RegistryError if any module or spec is broken."""
    specs, problems = load_specs()
    if problems:
        raise RegistryError("kernel registry problems:\n  " + "\n  ".join(problems))
    return specs

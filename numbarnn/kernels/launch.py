"""Kernel launches with less host work: numba-cuda's own launch, minus what it repeats at every call.

What ``kernel[grid, block, stream](*args)`` does in Python at every launch (numba-cuda 0.30, dispatcher.py):

    1. ``kernel[grid, block, stream]``: the geometry normalised, a _LaunchConfiguration (cached per geometry
       and stream, 128 of them), the stream wrapped as a cuda.core Stream;
    2. ``Dispatcher.call``: every argument typed (``typeof``: a numba type built per array) to pick the
       compiled overload;
    3. ``_Kernel.launch``: every array wrapped (``wrap_arg(a).to_device``) and packed by ``_prepare_args`` into
       5 + 2*ndim kernel parameters (meminfo, parent, size, itemsize, data, shape, strides in bytes), every
       scalar into a ctypes value, a cuda.core LaunchConfig built;
    4. ``cuda.core.launch(stream, config, cufunc.kernel, *params)``: the parameters into a C array, the driver.

On an H100's host a kernel with 12 arrays cost 63-135 us per launch (bench/results/gpu_h100.md, numba-cuda
0.30.4), while cuDNN's whole step takes ~2 us.  ``launch`` keeps step 4 as numba does it and does 1-3 once:

    - the overload is looked up once per dispatcher and argument *kind* (each array's dtype, ndim and layout as
      numba types it; each scalar's Python type), with numba's own typing;
    - each array's parameters are made once and kept on the array object (read from its cached
      ``_strided_memory_view_shim``, as ``_prepare_args`` reads them; a step loop passes the same arrays at every
      step), each scalar is converted as ``_prepare_args`` converts its parameter type;
    - the LaunchConfig and the stream are made once per geometry and stream.

What is left per launch (20 us here for the step kernel's 13 arguments, bench below): the kinds of the arguments
(a dict lookup per array), the parameter list (~100 values) and cuda.core's launch.

It is checked where it is made: the first launch of each (dispatcher, kind) packs the arguments both ways,
numba's ``_prepare_args`` and this module's, and launches the fast way only if the two parameter lists are
identical (else that kind keeps numba's path for good; ``STATS`` counts both).  Everything else goes through
numba's own ``kernel[grid, block, stream](*args)``: the simulator, host arrays (which numba copies), argument
types without a converter here (float16 scalars, records, tuples), debug kernels, kernels with extensions or
launch-config-sensitive ones, a numba-cuda without the internals named above, and any process whose first
launch saw NUMBARNN_FAST_LAUNCH=0.

``python bench/bench_launch_host.py`` measures steps 1-3 both ways without a GPU (fake device pointers).
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from .. import settings
from ..util import cdiv

FAST_LAUNCH_VAR = settings.SETTINGS["fast_launch"][0]

#: launches that took each path since the process started (or since ``STATS.clear()``)
STATS = {"fast": 0, "numba": 0}

_NUMBA = object()                   # a prepared entry meaning "this kind keeps numba's path"
_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``launch`` may take the fast path: numba not in simulator mode (the process's, whatever target is
    planned for), NUMBARNN_FAST_LAUNCH not 0, and a numba-cuda whose launch internals are the ones this module
    mirrors."""
    from numba import config  # lazy: numba after the simulator switch
    return not config.ENABLE_CUDASIM and settings.get("fast_launch") and _internals() is not None


@functools.cache
def _active():
    """What ``launch`` uses: the internals where ``enabled()`` as the process's first launch found it, else None
    (the environment is read once, not at every launch: reading it costs ~2 us)."""
    return _internals() if enabled() else None


@functools.cache
def _internals():
    """numba-cuda's pieces the fast path uses, or None where they are not all there (looked up once)."""
    try:
        from numba.cuda import dispatcher as nd  # lazy: numba.cuda after the simulator switch
        from numba.cuda._compat import CUDA_CORE_GE_1_0  # lazy: numba.cuda after the simulator switch
        from numba.cuda.cudadrv import devicearray, driver  # lazy: numba.cuda after the simulator switch
        from numba.cuda.errors import normalize_kernel_dimensions  # lazy: numba.cuda after the simulator switch
    except (ImportError, AttributeError):       # another numba-cuda: numba's own launch everywhere
        return None
    if not (hasattr(devicearray.DeviceNDArray, "_strided_memory_view_shim") and hasattr(nd._Kernel, "_prepare_args")):
        return None
    return {"DeviceNDArray": devicearray.DeviceNDArray, "Kernel": nd._Kernel, "launch": nd.launch,
            "LaunchConfig": nd.LaunchConfig, "to_core_stream": driver._to_core_stream,
            "normalize": normalize_kernel_dimensions, "core_ge_1": CUDA_CORE_GE_1_0}


# --------------------------------------------------------------------------------------------------
# arguments: what decides the overload (the kind) and what numba's _prepare_args makes of them
# --------------------------------------------------------------------------------------------------
_ENTRY = "_numbarnn_launch"          # where a device array keeps its (kind, parameters)


def _layout_of(a) -> str:
    """The layout numba types a device array with (DeviceNDArray._numba_type_): C, F, else A; broadcast: A."""
    shim = a._strided_memory_view_shim
    if 0 in a.strides and a.size != 0:
        return "A"
    return "C" if shim._layout.is_contiguous_c else ("F" if shim._layout.is_contiguous_f else "A")


def _array_entry(a):
    """(kind, parameters) of a device array: its (class, dtype, ndim, layout) and the 5 + 2*ndim kernel
    parameters _prepare_args makes of it (meminfo 0, parent 0, size, itemsize, data, shape, strides in bytes,
    read from the same shim), made once per array object and kept in its __dict__: an array's shape, strides,
    dtype and memory never change, and the driver passes the same objects at every step."""
    entry = a.__dict__.get(_ENTRY)
    if entry is None:
        s = a._strided_memory_view_shim
        entry = a.__dict__[_ENTRY] = ((type(a), a.dtype, a.ndim, _layout_of(a)),
                                      (0, 0, s.size, s.dtype.itemsize, s.ptr, *s.shape,
                                       *s._layout.strides_in_bytes))
    return entry


def argument_kinds(args, device_array_class) -> tuple | None:
    """What decides the overload numba picks, per argument: a device array's class, dtype, ndim and layout; a
    scalar's Python type (a Python int must fit int64, the type numba gives it).  None: an argument this
    module leaves to numba (a host array, a Python int beyond int64)."""
    kinds = []
    for v in args:
        t = type(v)
        if t is device_array_class:
            kinds.append(_array_entry(v)[0])
        elif t is int:
            if not -(1 << 63) <= v < (1 << 63):
                return None
            kinds.append(int)
        elif t is np.ndarray:
            return None
        else:
            kinds.append(t)
    return tuple(kinds)


def scalar_converter(ty):
    """How numba's _prepare_args passes a value of an integer / float / boolean parameter type (a ctypes
    type, or None: as it is); False for parameter types this module leaves to numba."""
    from numba.cuda import types  # lazy: numba.cuda after the simulator switch
    if isinstance(ty, types.Boolean):
        return None
    if isinstance(ty, types.Integer):
        return getattr(ctypes, f"c_{ty}")
    if ty == types.float64:
        return ctypes.c_double
    if ty == types.float32:
        return ctypes.c_float
    return False                      # float16, complex, records, tuples, ...: numba's path


class Prepared:
    """One compiled overload of a dispatcher for one kind of arguments: ``params(args)`` -> the kernel
    parameters numba's launch would pass for args of that kind."""

    _ARRAY = object()

    def __init__(self, kernel, converters):
        self.kernel = kernel                        # numba's _Kernel (the compiled overload)
        self.converters = converters                # per argument: _ARRAY, a ctypes type, or None (as is)
        self.configs: dict = {}                     # (grid, block, stream, sharedmem) -> (LaunchConfig, stream)

    def params(self, args) -> list:
        out: list = []
        for convert, v in zip(self.converters, args):
            if convert is Prepared._ARRAY:
                out += v.__dict__[_ENTRY][1]
            elif convert is None:
                out.append(v)
            else:
                out.append(convert(v))
        return out

    def config(self, grid, block, stream, sharedmem, internals):
        """(cuda.core LaunchConfig, cuda.core stream) as numba's launch makes them, once per geometry and stream
        (numba keeps its _LaunchConfiguration, which holds the converted stream, in a cache of the same key)."""
        key = (grid, block, stream, sharedmem)
        found = self.configs.get(key)
        if found is None:
            griddim, blockdim = internals["normalize"](grid, block)
            flag = "is_cooperative" if internals["core_ge_1"] else "cooperative_launch"
            config = internals["LaunchConfig"](grid=griddim, block=blockdim, shmem_size=sharedmem,
                                               **{flag: self.kernel.cooperative})
            found = self.configs[key] = (config, internals["to_core_stream"](stream))
        return found


def numba_params(kernel, args, stream=0) -> list:
    """The kernel parameters numba-cuda's own launch packs for ``args`` (its ``_Kernel._prepare_args``)."""
    params: list = []
    retr: list = []
    for t, v in zip(kernel.argument_types, args):
        kernel._prepare_args(t, v, stream, retr, params)
    return params


def same_params(ours: list, theirs: list) -> bool:
    """Identical parameter lists: the same Python values, ctypes values of the same type and value."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if type(a) is not type(b):
            return False
        if isinstance(a, ctypes._SimpleCData):
            if a.value != b.value:
                return False
        elif a != b:
            return False
    return True


def prepare(dispatcher, args, internals=None):
    """The Prepared overload of `dispatcher` for args' kind, checked against numba's packing of args; None when
    the overload is not compiled yet; _NUMBA when this kind must keep numba's path."""
    internals = internals or _internals()
    if internals is None or getattr(dispatcher, "_launch_config_sensitive", False) or \
            getattr(dispatcher, "specialized", False):
        return _NUMBA
    try:
        argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    except (TypeError, ValueError):   # a value numba cannot type: its own launch says so
        return _NUMBA
    kernel = dispatcher.overloads.get(argtypes)
    if kernel is None:
        return None
    if not isinstance(kernel, internals["Kernel"]) or getattr(kernel, "debug", False) or \
            getattr(kernel, "extensions", None) or getattr(kernel, "launch_config_sensitive", False):
        return _NUMBA
    from numba.cuda import types  # lazy: numba.cuda after the simulator switch
    converters = []
    for ty, v in zip(kernel.argument_types, args):
        if isinstance(ty, types.Array):
            if type(v) is not internals["DeviceNDArray"]:
                return _NUMBA
            converters.append(Prepared._ARRAY)
        else:
            convert = scalar_converter(ty)
            if convert is False:
                return _NUMBA
            converters.append(convert)
    prepared = Prepared(kernel, converters)
    if not same_params(prepared.params(args), numba_params(kernel, args)):
        return _NUMBA
    return prepared


_prepared: dict = {}                # (id(dispatcher), kinds) -> (dispatcher, Prepared | _NUMBA)


def launch(kernel, grid, block, *args, stream=0, sharedmem=0):
    """``kernel[grid, block, stream, sharedmem](*args)``, the host work of steps 1-3 (module docstring) done
    once per dispatcher and argument kind.  grid, block: ints or tuples, as numba takes them."""
    internals = _active()
    key = prepared = None
    if internals is not None and type(grid) is not list and type(block) is not list:
        kinds = argument_kinds(args, internals["DeviceNDArray"])
        if kinds is not None:
            key = (id(kernel), kinds)
            entry = _prepared.get(key)
            if entry is None or entry[0] is not kernel:
                entry = _remember(key, kernel, prepare(kernel, args, internals))
            if entry is not None and entry[1] is not _NUMBA:
                prepared = entry[1]
    if prepared is None:
        (kernel[grid, block] if not stream and not sharedmem else kernel[grid, block, stream, sharedmem])(*args)
        STATS["numba"] += 1
        if key is not None and _prepared.get(key) is None:
            # compiled by that launch: prepared from the next one on; an overload numba chose without compiling
            # one for exactly these types (a conversion) keeps numba's path
            _remember(key, kernel, prepare(kernel, args, internals) or _NUMBA)
        return
    config, core_stream = prepared.config(grid, block, stream, sharedmem, internals)
    internals["launch"](core_stream, config, prepared.kernel._codelibrary.get_cufunc().kernel,
                        *prepared.params(args))
    STATS["fast"] += 1


def _remember(key, kernel, found):
    """Keep what `prepare` found for key (not None: not compiled yet); the entry, or None."""
    if found is None:
        return None
    with _lock:
        entry = _prepared[key] = (kernel, found)
    return entry


# --------------------------------------------------------------------------------------------------
# without a GPU: both launch paths up to the driver call (bench/bench_launch_host.py, tests/test_launch.py)
# --------------------------------------------------------------------------------------------------
class _FakeMemory:
    """Device memory at a made-up address: what a DeviceNDArray reads its data pointer from."""

    def __init__(self, address: int):
        self.device_ctypes_pointer = ctypes.c_void_p(address)


def fake_device_array(shape, dtype, address: int, strides=None):
    """A numba DeviceNDArray of shape/strides (bytes; default C order) at a made-up device address: it types and
    packs as a real one, and must never reach a kernel."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray  # lazy: numba.cuda after the simulator switch
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(x) for x in np.empty(shape, dtype=np.int8).strides)
        strides = tuple(s * dtype.itemsize for s in strides) if strides else ()
    return DeviceNDArray(tuple(shape), tuple(strides), dtype, gpu_data=_FakeMemory(address))


class _FakeCodeLibrary:
    """A compiled kernel's code library, as far as a launch reads it (get_cufunc().kernel)."""

    class _CuFunc:
        kernel = "<the CUDA kernel>"

    def get_cufunc(self):
        return self._CuFunc()


def step_kernel_case(H: int = 768, B: int = 16, T: int = 1024, D: int = 1, dtype: str = "float32"):
    """The forward step kernel's launch as the driver makes it, for `driverless`: (a stand-in kernel with the step
    kernels' signature, common.step_signatures: 13 arguments, 12 of them arrays; its grid; its block; the
    arguments: step T-1 and fake device arrays of an LSTM of H units, batch B, T steps, D directions)."""
    from .common import step_signatures  # lazy: kernels.common imports numba.cuda

    def step(s, lens, gx, bias, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        pass
    G = 4
    shapes = [(B,), (D, T, B, G * H), (D, 2 * G + 1, H), (G * H, H), (G * H, H), (D, B, H), (D, B, H), (D, B, H),
              (T, B, D * H), (T, B, D, G * H), (T, B, D, H), (T, B, D, H)]
    sig = step_signatures(dtype)[0]
    args = [T - 1] + [fake_device_array(shape, str(ty.dtype), 0x100000 * (i + 1))
                      for i, (shape, ty) in enumerate(zip(shapes, sig[1:]))]
    return driverless_kernel(step, sig), (cdiv(H, 32), cdiv(B, 8), D), 64, args


def driverless_kernel(pyfunc, argtypes, cooperative: bool = False):
    """A cuda.jit dispatcher of pyfunc holding a stand-in compiled overload for argtypes (numba types), so that
    numba's ``kernel[grid, block](*args)`` and ``launch`` run all their host work without a GPU (never
    compiled; under ``driverless()`` nothing reaches a driver)."""
    from numba import cuda  # lazy: numba.cuda after the simulator switch
    from numba.cuda import dispatcher as nd  # lazy: numba.cuda after the simulator switch
    from numba.cuda import types  # lazy: numba.cuda after the simulator switch
    from numba.cuda.typing import signature  # lazy: numba.cuda after the simulator switch
    dispatcher = cuda.jit(pyfunc)
    kernel = nd._Kernel.__new__(nd._Kernel)
    kernel.signature = signature(types.void, *argtypes)
    kernel.extensions, kernel.cooperative, kernel.debug = [], cooperative, False
    kernel._codelibrary = _FakeCodeLibrary()
    kernel.entry_point = object()          # what the dispatcher's finalizer unregisters (unknown: it skips it)
    dispatcher.add_overload(kernel, tuple(argtypes))
    return dispatcher


def check_against_numba(rec, kernel, grid, block, args, stream=0, sharedmem=0) -> tuple:
    """Under `rec` (a ``driverless()``): numba's own launch of args, then ``launch`` twice (the first prepares the
    kind, the second takes the prepared path); AssertionError unless all three hand the driver the same
    parameters, LaunchConfig, stream and kernel, numba's first.  -> numba's recorded call (path, stream,
    LaunchConfig, kernel, parameters); rec.calls is left empty."""
    rec.calls.clear()
    (kernel[grid, block] if not stream and not sharedmem else kernel[grid, block, stream, sharedmem])(*args)
    launch(kernel, grid, block, *args, stream=stream, sharedmem=sharedmem)
    launch(kernel, grid, block, *args, stream=stream, sharedmem=sharedmem)
    calls, paths = list(rec.calls), [c[0] for c in rec.calls]
    rec.calls.clear()
    if paths != ["numba", "fast", "fast"]:
        raise AssertionError(f"expected numba's launch, then two fast ones; got {paths}")
    theirs = calls[0]
    for ours in calls[1:]:
        if not same_params(ours[4], theirs[4]) or ours[1:4] != theirs[1:4]:
            raise AssertionError(f"launch.py hands the driver {ours[1:]}, numba {theirs[1:]}")
    return theirs


class _RecordedLaunchConfig:
    """What a cuda.core LaunchConfig was made with (driverless): equal when made with the same fields."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __eq__(self, other):
        return type(other) is type(self) and vars(other) == vars(self)

    def __repr__(self):
        return f"LaunchConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class driverless:
    """Context manager: the driver calls of both launch paths recorded instead of made.  ``calls``: one
    (path, stream, LaunchConfig, kernel, params) per launch, path "numba" or "fast"."""

    def __init__(self):
        self.calls: list = []

    def __enter__(self):
        from numba.cuda import dispatcher as nd  # lazy: numba.cuda after the simulator switch
        from numba.cuda.cudadrv import driver  # lazy: numba.cuda after the simulator switch
        internals = _internals()
        if internals is None:
            raise RuntimeError("this numba-cuda lacks the internals numbarnn's fast launch mirrors")
        self._saved = (nd.launch, nd.LaunchConfig, driver._to_core_stream, dict(internals))

        def recorder(path):
            return lambda stream, config, kernel, *params: self.calls.append((path, stream, config, kernel,
                                                                              list(params)))
        nd.launch, internals["launch"] = recorder("numba"), recorder("fast")
        # cuda.core's LaunchConfig asks the device about cooperative launches: a record of its fields instead
        nd.LaunchConfig = internals["LaunchConfig"] = _RecordedLaunchConfig
        driver._to_core_stream = internals["to_core_stream"] = lambda stream: f"<stream {stream}>"
        return self

    def __exit__(self, *exc):
        from numba.cuda import dispatcher as nd  # lazy: numba.cuda after the simulator switch
        from numba.cuda.cudadrv import driver  # lazy: numba.cuda after the simulator switch
        nd.launch, nd.LaunchConfig, driver._to_core_stream, saved = self._saved
        _internals().update(saved)
        _prepared.clear()
        return False

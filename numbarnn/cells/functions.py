"""Scalar activation helpers for cell definitions: plain Python that every backend compiles.

A cell's pointwise functions call these by name.  Run as they are, they are ordinary Python (the CUDA
simulator and the reference backend built from a spec run them so); when a kernel template compiles a cell,
each name is rebound to the target's typed twin (`numbarnn.kernels.cell_steps.device_function`), which
computes in the kernel's compute dtype.  Python float literals in a cell (``1.0 - z``) are correct too, but
compute in float64 on a GPU (slower): the helpers below keep float32 kernels in float32.

SPEC 2: σ and tanh in a form that cannot overflow; backward derivatives from the saved activations.
"""
import math
import types as _types


def sigmoid(x):
    """σ(x) = 1/(1+e^-x), written 0.5*tanh(0.5x)+0.5: no exp to overflow."""
    return 0.5 * math.tanh(0.5 * x) + 0.5


def tanh(x):
    return math.tanh(x)


def relu(x):
    """max(0, x); NaN propagates (NaN <= 0 is False), as numpy.maximum."""
    return 0.0 if x <= 0.0 else x


def dsigmoid(s):
    """dσ/dx from the saved s = σ(x): s(1-s)."""
    return s * (1.0 - s)


def dtanh(t):
    """dtanh/dx from the saved t = tanh(x): 1-t²."""
    return 1.0 - t * t


def drelu(r):
    """drelu/dx from the saved r = relu(x): 1 where r > 0 (0 at x = 0, as cuDNN)."""
    return 1.0 if r > 0.0 else 0.0


def one_minus(x):
    """1 - x (e.g. a coupled forget gate f = 1 - i) in the compute dtype."""
    return 1.0 - x


#: every helper, by name: the kernel templates rebind exactly these
HELPERS = {f.__name__: f for f in (sigmoid, tanh, relu, dsigmoid, dtanh, drelu, one_minus)}


def compile_with_twins(fn, twins: dict, compile):
    """`fn` (plain Python) compiled by `compile` (a decorator: cuda.jit(device=True), numba.njit, ...) with every
    function it calls by global name replaced: a key of `twins` (a helper above) by its value (the target's
    typed twin), any other plain Python function, or a numba dispatcher's Python source (``.py_func``, e.g. a
    CUDA device function reused on the CPU), compiled the same way, recursively.  `fn` itself is untouched:
    the rebinding happens in a copy of its globals.  (The kernels' `device_function` and the CPU backend's
    `njit_function` are this with their own twins.)"""
    globals_ = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        value = globals_.get(name)
        if isinstance(value, _types.FunctionType):
            globals_[name] = twins.get(value) or compile_with_twins(value, twins, compile)
        elif isinstance(getattr(value, "py_func", None), _types.FunctionType):
            globals_[name] = compile_with_twins(value.py_func, twins, compile)
    rebound = _types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__qualname__ = fn.__qualname__
    rebound.__module__ = fn.__module__
    return compile(rebound)

"""Scalar activation helpers for cell definitions: plain Python that every backend compiles.

A cell's pointwise functions call these by name.  Run as they are, they are ordinary Python (the CUDA
simulator and the reference backend built from a spec run them so); when a kernel template compiles a cell,
each name is rebound to the target's typed twin (`numbarnn.kernels.cell_steps.device_function`), which
computes in the kernel's compute dtype.  Python float literals in a cell (``1.0 - z``) are correct too, but
compute in float64 on a GPU (slower): the helpers below keep float32 kernels in float32.

SPEC 2: σ and tanh in a form that cannot overflow; backward derivatives from the saved activations.
"""
import math


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

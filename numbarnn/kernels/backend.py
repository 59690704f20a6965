"""The "cuda" backend: numba.cuda kernels (on a GPU, or in numba's CUDA simulator).

Array rule: if `input` (or `x`) is a NumPy array, every array is copied to the device once, the kernels run,
and every result comes back as a NumPy array (one copy each way).  If it is a device array (a numba device
array or anything with ``__cuda_array_interface__``: CuPy, torch CUDA tensors, ...), results are numba
device arrays and nothing goes through the host; the reserve space then stays on the device.
The contract of each function is the reference backend's (`numbarnn/reference/backend.py`).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .. import reserve as _reserve
from ..validation import is_device_array
from . import block_lstm as _bl
from . import driver
from .common import blocks, jit, make_swap01, threads
from .launch import launch

last_launch_count = driver.last_launch_count
launch_plan = driver.launch_plan


def to_device(a):
    """NumPy -> a new device array; device arrays pass through (made contiguous if they are not)."""
    if a is None:
        return None
    if isinstance(a, np.ndarray) or not is_device_array(a):
        return cuda.to_device(np.ascontiguousarray(a))
    d = a if cuda.devicearray.is_cuda_ndarray(a) else cuda.as_cuda_array(a)
    if not d.is_c_contiguous():
        out = cuda.device_array(d.shape, dtype=d.dtype)
        out.copy_to_device(d)   # pragma: no cover - strided views from other libraries
        d = out
    return d


def _on_host(a) -> bool:
    return not is_device_array(a)


def _out(host: bool, *arrays):
    return tuple(None if a is None else (a.copy_to_host() if host else a) for a in arrays)


def swap01(a):
    """Swap the first two axes into a new contiguous array, on the side where `a` lives."""
    if _on_host(a):
        return np.ascontiguousarray(np.swapaxes(np.asarray(a), 0, 1))
    d = to_device(a)
    shape = tuple(d.shape)
    out = cuda.device_array((shape[1], shape[0]) + shape[2:], dtype=d.dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if n:
        K = n // (shape[0] * shape[1])
        launch(jit(make_swap01, str(d.dtype)), blocks(n, threads(n, 256)), threads(n, 256),
               d.reshape(shape[0], shape[1], K), out.reshape(shape[1], shape[0], K))
    return out


def zeros(shape, dtype, like=None):
    if like is None or _on_host(like):
        return np.zeros(shape, dtype=dtype)
    return driver.device_zeros(tuple(shape), dtype)


def write_nonce(reserve, nonce) -> None:
    """`numbarnn.reserve.write_nonce` without waiting for the device: a device reserve's nonce is written by a
    launch (a copy from host memory would first wait for the forward's kernels)."""
    if _on_host(reserve):
        return _reserve.write_nonce(reserve, nonce)
    driver.write_nonce(to_device(reserve), nonce)


def rnn_forward(call, x, h0, c0, params):
    host = _on_host(x)
    y, hT, cT, reserve = driver.forward(call, to_device(x), to_device(h0), to_device(c0), to_device(params))
    if cT is None:
        cT = cuda.device_array((0,), dtype=call.dtype)
    return _out(host, y, hT, cT, reserve)


def rnn_backward(call, x, h0, c0, params, dy, dhT, dcT, reserve):
    host = _on_host(x)
    dev = [to_device(a) for a in (x, h0, c0, params, dy, dhT, dcT, reserve)]
    return _out(host, *driver.backward(call, *dev))


def block_lstm(call, *arrays):
    host = _on_host(arrays[0])
    return _out(host, *_bl.forward(call, *[to_device(a) for a in arrays]))


def block_lstm_grad(call, *arrays):
    host = _on_host(arrays[0])
    return _out(host, *_bl.backward(call, *[to_device(a) for a in arrays]))

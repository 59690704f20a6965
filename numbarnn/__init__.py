"""numbarnn: cuDNN's RNN ops and TensorFlow's BlockLSTM ops as numba.cuda kernels, checked against NumPy.

    numbarnn.ops              TF-style ops (cudnn_rnn_v3, cudnn_rnn_backprop_v3, block_lstm, ...)
    numbarnn.cells            cells as data: CellSpec, register (user cells work everywhere)
    numbarnn.CudnnLSTM, ...   Keras-style layers that own their params (numbarnn.layers); CudnnRNN(cell, ...)
    numbarnn.models           the config-only models of tf.contrib.cudnn_rnn's ops module
    numbarnn.torch            drop-ins for torch.nn.LSTM/GRU/RNN and the cells (optional extra; imported on
                              first use: `import numbarnn` alone never imports torch)
    numbarnn.testing          hypothesis strategies and gradient checks
    set_default_backend       "cpu" (numba.njit + BLAS; the default without a GPU), "cuda" (numba.cuda kernels)
                              or "reference" (the float64 NumPy oracle)
    release_workspaces        free the scratch the cpu and cuda backends keep between calls (this thread)
"""
import importlib

from . import cells, layers, models, ops
from .backends import get_default_backend, release_workspaces, set_default_backend
from .layers import CudnnGRU, CudnnLSTM, CudnnRNN, CudnnRNNRelu, CudnnRNNTanh

__version__ = "0.1.0"
__all__ = ["ops", "cells", "layers", "models", "CudnnRNN", "CudnnLSTM", "CudnnGRU", "CudnnRNNTanh", "CudnnRNNRelu",
           "set_default_backend", "get_default_backend", "release_workspaces"]


def __getattr__(name):
    """`numbarnn.torch` (and `numbarnn.testing`) on first use, so `import numbarnn` stays free of torch and
    hypothesis; without torch installed the ImportError says which extra to install."""
    if name in ("torch", "testing"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

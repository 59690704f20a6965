"""PyTorch's own RNN module tests, run against numbarnn.torch's drop-ins (skipped without torch).

Ported from PyTorch's test suite, each test named as in PyTorch and its docstring naming the test it ports:

* test/test_nn.py: the RNN / GRU / LSTM / cell tests of ``TestNN`` and ``TestNNDeviceType`` (CPU);
* test/test_autocast.py: the CPU ``test_autocast_rnn``;
* test/test_modules.py: the generic ``TestModule`` tests, run over the ``module_db`` entries that the installed
  wheel ships (torch/testing/_internal/common_modules.py) for torch.nn.RNN, GRU, LSTM, RNNCell, GRUCell and
  LSTMCell: their ``module_inputs_func`` and ``module_error_inputs_func`` are called as PyTorch calls them, and
  each sample is run against the drop-in.

``torch.nn.X`` becomes ``numbarnn.torch.X`` (RNN, GRU, LSTM, RNNCell, GRUCell, LSTMCell); a drop-in that does not
exist makes its tests fail (not skip).  Where a PyTorch test compares two implementations (CPU against cuDNN, CPU
against the fused CUDA kernels) the second one is numbarnn's, the first torch.nn's.  Assertions are PyTorch's:
``assertEqual`` is PyTorch's own ``TestCase.assertEqual`` (same tolerances and ``precision`` / ``rel_tol``
floors as the test class it comes from), ``assertRaisesRegex`` is ``pytest.raises(match=...)``.

Set ``NUMBARNN_PYTORCH_SUITE_TARGET=torch`` to run the same tests against torch.nn's own classes (a check of the
port itself).  By default ``test_grad`` / ``test_gradgrad`` run a fixed subset of the RNN/GRU/LSTM samples of
module_db that still takes every constructor option both ways (``_GRAD_SAMPLES``; PyTorch runs all 32/16/32 of
them, which takes minutes); ``NUMBARNN_PYTORCH_SUITE=full`` runs every sample.  Tests of CUDA-only internals are
left out: ``LEFT_OUT`` names each with its reason.  PyTorch tests that run only where CUDA is but check nothing
CUDA-specific run here on the CPU (their docstrings say so); test_modules' onlyCUDA ``test_cpu_gpu_parity`` and
``test_multiple_device_transfer`` are ported but skip without a CUDA build of torch and a GPU.

numbarnn runs on its default backend.  By design (not failures): dropout masks are numbarnn's Philox masks, not
torch's (same distribution); the constructors take an extra keyword-only ``backend``; there are no cuDNN
flat-weight internals (``_flat_weights`` exists, ``flatten_parameters()`` is a no-op).
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import random
import re
import sys
import tempfile
import types
import unittest
import warnings
from copy import deepcopy
from inspect import isgenerator
from itertools import chain, product
from operator import methodcaller
from unittest.mock import call, patch

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.utils.rnn as rnn_utils  # noqa: E402

import numbarnn.kernels.common  # noqa: E402,F401  (see below)
import numbarnn.torch as numbarnn_torch  # noqa: E402

# numbarnn.kernels.common installs numbarnn's fixes to numba's CUDA simulator when first imported (numbarnn's ops
# import it at their first call).  Imported here, at collection, as the kernel tests' imports do: otherwise the
# first test of a worker to call an op would change the simulator's state, which conftest.py reports as an error.


def _import_pytorch_testing():
    """torch.testing._internal's common_modules and common_utils, without their side effects on this process.

    common_utils imports ``expecttest`` (not a dependency of numbarnn: a stand-in module is used while importing
    when it is not installed) and freezes torch.backends' global flags (``disable_global_flags``), which would make
    every later ``torch.backends.<x>.<flag> = v`` in this process raise; the flags are unfrozen again.
    """
    shim = None
    try:
        import expecttest  # noqa: F401
    except ImportError:
        shim = types.ModuleType("expecttest")
        shim.TestCase = unittest.TestCase
        shim.ACCEPT = False
        sys.modules["expecttest"] = shim
    frozen = torch.backends.flags_frozen()
    try:
        from torch.testing._internal import common_modules, common_utils
        from torch._subclasses.meta_utils import assert_metadata_eq
    finally:
        if not frozen:
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        if shim is not None and sys.modules.get("expecttest") is shim:
            del sys.modules["expecttest"]
    return common_modules, common_utils, assert_metadata_eq


common_modules, common_utils, assert_metadata_eq = _import_pytorch_testing()
ModuleErrorEnum = common_modules.ModuleErrorEnum
freeze_rng_state = common_utils.freeze_rng_state
gradcheck = common_utils.gradcheck
gradgradcheck = common_utils.gradgradcheck
set_default_dtype = common_utils.set_default_dtype
dtype2prec_DONTUSE = common_utils.dtype2prec_DONTUSE

DEVICE = "cpu"
TARGET = os.environ.get("NUMBARNN_PYTORCH_SUITE_TARGET", "numbarnn")
FULL = os.environ.get("NUMBARNN_PYTORCH_SUITE", "") == "full"
TEST_CUDA = torch.cuda.is_available()

#: PyTorch tests not ported, each with the reason (all exercise CUDA-only internals)
LEFT_OUT = {
    "test_nn.py TestNN.test_rnn_check_device":
        "multi-GPU only: errors for inputs / hidden states / weights on different CUDA devices",
    "test_nn.py TestNN.test_projections_lstm_check_device":
        "multi-GPU only: the same device checks for LSTM with projections",
    "test_nn.py TestNN.test_cudnn_rnn_dropout_states_device":
        "multi-GPU only: cuDNN's dropout state allocated on GPU 1",
    "test_nn.py TestNN.test_cudnn_weight_format":
        "cuDNN's flat weight buffer: the 'weights are not part of single contiguous chunk of memory' warning "
        "after a weight is re-set; numbarnn has no flat weight buffer",
    "test_nn.py TestNN.test_cudnn_weight_tying":
        "cuDNN's flat weight buffer with tied weights, on CUDA; numbarnn has no flat weight buffer",
    "test_nn.py TestNN.test_pack_sequence_batch_sizes_throw":
        "CUDA only: a PackedSequence whose batch_sizes live on the GPU (torch.nn.utils.rnn's check)",
    "test_nn.py TestNNDeviceType._test_rnn_mod (its `inp.is_cuda` branch)":
        "cuDNN only: the 'please disable the CuDNN backend temporarily' double-backward error; the CPU part "
        "runs in test_LSTM_grad_and_gradgrad / test_GRU_grad_and_gradgrad",
    "CUDA test_autocast_rnn (cudnn RNNs under torch.autocast('cuda'))":
        "cuDNN only: fp16 weight casting and re-flattening under CUDA autocast; the CPU test_autocast_rnn of "
        "test/test_autocast.py is ported",
}


# ---------------------------------------------------------------------------------------------------------
# PyTorch's assertions, the modules under test, the set-up PyTorch's TestCase does
# ---------------------------------------------------------------------------------------------------------

class _PyTorchAssertions(common_utils.TestCase):
    __test__ = False  # a unittest.TestCase, which pytest would otherwise collect

    def runTest(self):  # pragma: no cover - never run: the instance only lends its assert methods
        pass


def _assertions(precision: float = 0.0, rel_tol: float = 0.0):
    tc = _PyTorchAssertions()
    tc.precision, tc.rel_tol = precision, rel_tol
    return tc


#: TestNN / TestNNDeviceType (NNTestCase): no tolerance floor
NN = _assertions()
#: test_modules.TestModule: precision = rel_tol = 1e-5
MODULES = _assertions(1e-5, 1e-5)


def dropin(name: str):
    """The class under test for torch.nn.<name>: numbarnn.torch's (a missing one fails the test)."""
    if TARGET == "torch":
        return getattr(torch.nn, name)
    cls = getattr(numbarnn_torch, name, None)
    if cls is None:
        pytest.fail(f"numbarnn.torch.{name} does not exist (no drop-in for torch.nn.{name})")
    return cls


def is_lstm(module) -> bool:
    return isinstance(module, nn.LSTM) or type(module).__name__ == "LSTM"


def _devices():
    return ["cpu"] + (["cuda"] if TEST_CUDA else [])


@pytest.fixture(autouse=True)
def _pytorch_test_setup():
    """PyTorch's TestCase.setUp seeds every RNG with common_utils.SEED; the states are restored afterwards.

    Each test also runs with one intra-op thread: under ``pytest -n 2`` on two cores, the workers' OpenMP threads
    otherwise oversubscribe the CPU and torch.nn's small kernels run 10-30 times slower.
    """
    state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    threads = torch.get_num_threads()
    common_utils.set_rng_seed(common_utils.SEED)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


# ---------------------------------------------------------------------------------------------------------
# test/test_nn.py: TestNN
# ---------------------------------------------------------------------------------------------------------

def test_RNN_cell():
    """Ports test_nn.py TestNN.test_RNN_cell."""
    # this is just a smoke test; these modules are implemented through
    # autograd so no Jacobian test is needed
    for module in (dropin("RNNCell"), dropin("GRUCell")):
        for bias in (True, False):
            input = torch.randn(3, 10)
            hx = torch.randn(3, 20)
            cell = module(10, 20, bias=bias)
            for _ in range(6):
                hx = cell(input, hx)

            hx.sum().backward()


def test_RNN_cell_forward_zero_hidden_size():
    """Ports test_nn.py TestNN.test_RNN_cell_forward_zero_hidden_size."""
    RNNCell, GRUCell = dropin("RNNCell"), dropin("GRUCell")
    input = torch.randn(3, 10)
    hx = torch.randn(3, 0)
    cell_shared_param = (10, 0)
    for cell in (RNNCell(*cell_shared_param, nonlinearity="relu"),
                 RNNCell(*cell_shared_param, nonlinearity="tanh"),
                 GRUCell(*cell_shared_param)):
        NN.assertEqual(cell(input, hx).shape, torch.Size([3, 0]))


def test_RNN_cell_no_broadcasting():
    """Ports test_nn.py TestNN.test_RNN_cell_no_broadcasting."""
    RNNCell, GRUCell, LSTMCell = dropin("RNNCell"), dropin("GRUCell"), dropin("LSTMCell")

    def test(cell_module, input, hx, input_size, hidden_size):
        cell = cell_module(input_size, hidden_size)
        with pytest.raises(RuntimeError):
            cell(input, hx)

    def test_all(hidden_size, bad_hx, good_hx, input_size, input):
        test(RNNCell, input, bad_hx, input_size, hidden_size)
        test(GRUCell, input, bad_hx, input_size, hidden_size)
        test(LSTMCell, input, (bad_hx, good_hx), input_size, hidden_size)
        test(LSTMCell, input, (good_hx, bad_hx), input_size, hidden_size)

    hidden_size = 20
    input_size = 10
    input = torch.randn(3, input_size)
    bad_hx = torch.randn(1, hidden_size)
    good_hx = torch.randn(3, hidden_size)

    # Test hidden/input batch size broadcasting
    test_all(hidden_size, bad_hx, good_hx, input_size, input)

    # Test hx's hidden_size vs module's hidden_size broadcasting
    bad_hx = torch.randn(3, 1)
    test_all(hidden_size, bad_hx, good_hx, input_size, input)

    # Test input's input_size vs module's input_size broadcasting
    bad_input = torch.randn(3, 1)
    test_all(hidden_size, good_hx, good_hx, input_size, bad_input)


def test_LSTM_cell():
    """Ports test_nn.py TestNN.test_LSTM_cell."""
    LSTMCell = dropin("LSTMCell")
    # this is just a smoke test; these modules are implemented through
    # autograd so no Jacobian test is needed
    for bias in (True, False):
        input = torch.randn(3, 10)
        hx = torch.randn(3, 20)
        cx = torch.randn(3, 20)
        lstm = LSTMCell(10, 20, bias=bias)
        for _ in range(6):
            hx, cx = lstm(input, (hx, cx))

        (hx + cx).sum().backward()


def test_LSTM_cell_forward_input_size():
    """Ports test_nn.py TestNN.test_LSTM_cell_forward_input_size."""
    LSTMCell = dropin("LSTMCell")
    input = torch.randn(3, 11)
    hx = torch.randn(3, 20)
    cx = torch.randn(3, 20)
    lstm = LSTMCell(10, 20)
    with pytest.raises(Exception):
        lstm(input, (hx, cx))


def test_LSTM_cell_forward_hidden_size():
    """Ports test_nn.py TestNN.test_LSTM_cell_forward_hidden_size."""
    LSTMCell = dropin("LSTMCell")
    input = torch.randn(3, 10)
    hx = torch.randn(3, 21)
    cx = torch.randn(3, 20)
    lstm = LSTMCell(10, 20)
    with pytest.raises(Exception):
        lstm(input, (hx, cx))
    with pytest.raises(Exception):
        lstm(input, (cx, hx))


def test_cudnn_forward_exception():
    """Ports test_nn.py TestNN.test_cudnn_forward_exception (it runs on the CPU, despite its name)."""
    LSTM, GRU, RNN = dropin("LSTM"), dropin("GRU"), dropin("RNN")
    rnns = [
        (LSTM(10, 20, batch_first=True), (torch.zeros(1, 2, 19), torch.zeros(1, 2, 19))),
        (LSTM(10, 20, batch_first=True, proj_size=10), (torch.zeros(1, 2, 19), torch.zeros(1, 2, 19))),
        (GRU(10, 20, batch_first=True), torch.zeros(1, 2, 19)),
        (RNN(10, 20, batch_first=True), torch.zeros(1, 2, 19)),
    ]
    x_wrong = torch.randn(2, 3, 3)
    x_right = torch.randn(2, 3, 10)
    for rnn, hidden in rnns:
        with pytest.raises(RuntimeError, match="Expected hidden.*size.*got"):
            rnn(x_right, hidden)
        with pytest.raises(RuntimeError, match=re.escape("input.size(-1) must be equal to input_size")):
            rnn(x_wrong)


def test_rnn_args_check():
    """Ports test_nn.py TestNN.test_rnn_args_check."""
    input_size = 3
    hidden_size = 5
    num_layers = 2
    batch_size = 4
    seq_len = 6
    num_directions = 1
    bad_size = 7  # prime number so that no size can divide it.

    def test(input_shape, hidden_shape, mode):
        for input, hidden in get_inputs(input_shape, hidden_shape, mode):
            model = dropin(mode)(input_size, hidden_size, num_layers)
            with pytest.raises(RuntimeError):
                model(input, hidden)

    correct_input_shape = (seq_len, batch_size, input_size)
    correct_hidden_shape = (num_layers * num_directions, batch_size, hidden_size)

    def update_shape(shape, dim, new_dim_size):
        new_shape = list(shape)
        new_shape[dim] = new_dim_size
        return tuple(new_shape)

    def get_inputs(input_shape, hidden_shape, mode):
        '''returns list( tuple(input, hidden) )
        where input, hidden are inputs to a model'''
        input = torch.randn(input_shape)
        hidden = torch.randn(hidden_shape)
        if mode != 'LSTM':
            return [(input, hidden)]
        if hidden_shape == correct_hidden_shape:
            return [(input, (hidden, hidden))]
        good_hidden = torch.randn(correct_hidden_shape)
        return [
            (input, (hidden, good_hidden)),
            (input, (good_hidden, hidden)),
        ]

    rnn_modes = ['RNN', 'GRU', 'LSTM']
    for mode in rnn_modes:
        # Incorrect input batch size
        input_shape = update_shape(correct_input_shape, 1, bad_size)
        hidden_shape = correct_hidden_shape
        test(input_shape, hidden_shape, mode)

        # Incorrect hidden batch size
        input_shape = correct_input_shape
        hidden_shape = update_shape(correct_hidden_shape, 1, bad_size)
        test(input_shape, hidden_shape, mode)

        # Incorrect input size
        input_shape = update_shape(correct_input_shape, 2, bad_size)
        hidden_shape = correct_hidden_shape
        test(input_shape, hidden_shape, mode)

        # Incorrect hidden size
        input_shape = correct_input_shape
        hidden_shape = update_shape(correct_hidden_shape, 2, bad_size)
        test(input_shape, hidden_shape, mode)

        # Incorrect hidden[0]
        input_shape = correct_input_shape
        hidden_shape = update_shape(correct_hidden_shape, 0, bad_size)
        test(input_shape, hidden_shape, mode)


def test_projections_lstm_args_check():
    """Ports test_nn.py TestNN.test_projections_lstm_args_check."""
    LSTM = dropin("LSTM")
    input_size = 3
    hidden_size = 5
    proj_size = 2
    num_layers = 2
    batch_size = 4
    seq_len = 6
    num_directions = 1
    bad_size = 7  # prime number so that no size can divide it.

    def test(input_shape, hidden_h_shape, hidden_c_shape):
        for input, hidden in get_inputs(input_shape, hidden_h_shape, hidden_c_shape):
            model = LSTM(input_size, hidden_size, num_layers, proj_size=proj_size)
            with pytest.raises(RuntimeError):
                model(input, hidden)

    correct_input_shape = (seq_len, batch_size, input_size)
    correct_hidden_h_shape = (num_layers * num_directions, batch_size, proj_size)
    correct_hidden_c_shape = (num_layers * num_directions, batch_size, hidden_size)

    def update_shape(shape, dim, new_dim_size):
        new_shape = list(shape)
        new_shape[dim] = new_dim_size
        return tuple(new_shape)

    def get_inputs(input_shape, hidden_h_shape, hidden_c_shape):
        '''returns list( tuple(input, hidden) )
        where input, hidden are inputs to a model'''
        input = torch.randn(input_shape)
        hidden_h = torch.randn(hidden_h_shape)
        hidden_c = torch.randn(hidden_c_shape)
        return [(input, (hidden_h, hidden_c))]

    # Incorrect input batch size
    input_shape = update_shape(correct_input_shape, 1, bad_size)
    test(input_shape, correct_hidden_h_shape, correct_hidden_c_shape)

    # Incorrect hidden batch size
    input_shape = correct_input_shape
    hidden_h_shape = update_shape(correct_hidden_h_shape, 1, bad_size)
    hidden_c_shape = update_shape(correct_hidden_c_shape, 1, bad_size)
    test(input_shape, hidden_h_shape, hidden_c_shape)

    # Incorrect input size
    input_shape = update_shape(correct_input_shape, 2, bad_size)
    test(input_shape, correct_hidden_h_shape, correct_hidden_c_shape)

    # Incorrect hidden size
    input_shape = correct_input_shape
    hidden_h_shape = update_shape(correct_hidden_h_shape, 2, bad_size)
    hidden_c_shape = update_shape(correct_hidden_c_shape, 2, bad_size)
    test(input_shape, hidden_h_shape, hidden_c_shape)

    # Incorrect hidden[0]
    input_shape = correct_input_shape
    hidden_h_shape = update_shape(correct_hidden_h_shape, 0, bad_size)
    hidden_c_shape = update_shape(correct_hidden_c_shape, 0, bad_size)
    test(input_shape, hidden_h_shape, hidden_c_shape)

    # Incorrect proj size = hidden size
    input_shape = correct_input_shape
    hidden_h_shape = update_shape(correct_hidden_h_shape, 0, hidden_size)
    hidden_c_shape = correct_hidden_c_shape
    test(input_shape, hidden_h_shape, hidden_c_shape)

    # Incorrect proj size != hidden size
    input_shape = correct_input_shape
    hidden_h_shape = update_shape(correct_hidden_h_shape, 0, bad_size)
    hidden_c_shape = correct_hidden_c_shape
    test(input_shape, hidden_h_shape, hidden_c_shape)

    # Incorrect cell size != hidden size
    input_shape = correct_input_shape
    hidden_h_shape = correct_hidden_h_shape
    hidden_c_shape = update_shape(correct_hidden_c_shape, 0, bad_size)
    test(input_shape, hidden_h_shape, hidden_c_shape)


def test_rnn_initial_hidden_state():
    """Ports test_nn.py TestNN.test_rnn_initial_hidden_state."""
    rnn_modes = ['RNN', 'GRU', 'LSTM']
    for mode in rnn_modes:
        rnn = dropin(mode)(30, 20, 2)
        input = torch.randn(10, 32, 30)
        hidden = torch.zeros(2, 32, 20)

        if mode == 'LSTM':
            hidden = (hidden, hidden)
        output1, hidden1 = rnn(input, hidden)
        output2, hidden2 = rnn(input)
        NN.assertEqual(output1, output2)
        NN.assertEqual(hidden1, hidden2)


def test_projections_lstm_initial_hidden_state():
    """Ports test_nn.py TestNN.test_projections_lstm_initial_hidden_state."""
    LSTM = dropin("LSTM")
    for bidir in [False, True]:
        rnn = LSTM(30, 20, 2, bidirectional=bidir, proj_size=10)
        num_dirs = 2 if bidir else 1
        input = torch.randn(10, 32, 30)
        hidden_h = torch.zeros(2 * num_dirs, 32, 10)
        hidden_c = torch.zeros(2 * num_dirs, 32, 20)
        hidden = (hidden_h, hidden_c)
        output1, hidden1 = rnn(input, hidden)
        output2, hidden2 = rnn(input)
        NN.assertEqual(output1, output2)
        NN.assertEqual(hidden1, hidden2)


def test_projections_errors_on_gru_and_rnn():
    """Ports test_nn.py TestNN.test_projections_errors_on_gru_and_rnn."""
    error_msg = "proj_size argument is only supported for LSTM, not RNN or GRU"
    for mode in ['RNN', 'GRU']:
        with pytest.raises(ValueError, match=error_msg):
            dropin(mode)(30, 20, 2, proj_size=10)


def _test_RNN_cpu_vs_cudnn(dropout, dtype=torch.double):
    """test_nn.py TestNN._test_RNN_cpu_vs_cudnn with numbarnn in cuDNN's place: the first module of each pair is
    torch.nn's (CPU), the second ("gpu") the drop-in, also on the CPU; the weights are copied across as there."""

    def forward_backward(cuda, rnn, input_val, grad_output, weights_val, hx_val, grad_hy,
                         cx_val=None, grad_cy=None):
        is_lstm = isinstance(rnn, nn.LSTM) or type(rnn).__name__ == "LSTM"

        for x_layer, y_layer in zip(rnn.all_weights, weights_val):
            for x, y in zip(x_layer, y_layer):
                x.data.copy_(y.data)

        if isinstance(input_val, rnn_utils.PackedSequence):
            input = rnn_utils.PackedSequence(
                input_val.data.data.requires_grad_(True), input_val.batch_sizes)
            input_var = input.data
        else:
            input = input_val.clone().requires_grad_(True)
            input_var = input
        if is_lstm:
            if cx_val is None:
                hx = (hx_val.clone().requires_grad_(True),
                      hx_val.add(1).requires_grad_(True))
            else:
                hx = (hx_val.clone().requires_grad_(True),
                      cx_val.add(1).requires_grad_(True))
        else:
            hx = hx_val.clone().requires_grad_(True)

        # (the `if cuda:` moves to the GPU are gone: both modules run on the CPU)

        output, hy = rnn(input, hx)

        if isinstance(output, rnn_utils.PackedSequence):
            output = output.data

        if is_lstm:
            if grad_cy is None:
                torch.autograd.backward([output, hy[0], hy[1]], [grad_output, grad_hy, grad_hy + 1])
            else:
                torch.autograd.backward([output, hy[0], hy[1]], [grad_output, grad_hy, grad_cy + 1])
        else:
            torch.autograd.backward([output, hy], [grad_output, grad_hy])

        return {'output': output.data,
                'hy': hy[0].data if is_lstm else hy.data,
                'weights': rnn.all_weights,
                'grad_input': input_var.grad.data,
                'grad_hx': hx[0].grad.data if is_lstm else hx.grad.data,
                'cy': hy[1].data if is_lstm else None,
                'grad_cx': hx[1].grad.data if is_lstm else None}

    input_size = 10
    hidden_size = 6
    proj_size = 3
    num_layers = 2
    seq_length = 7
    batch = 6

    def make_noncontig(tensor):
        ndim = tensor.dim()
        return torch.stack([tensor.clone().zero_(), tensor], ndim).select(ndim, 1)

    def compare_cpu_gpu(outputs_cpu, outputs_gpu):
        NN.assertEqual(list(outputs_cpu.keys()), list(outputs_gpu.keys()))
        for key in outputs_cpu.keys():
            if key != 'weights':
                NN.assertEqual(outputs_cpu[key], outputs_gpu[key], atol=5e-5, rtol=0, msg=key)

        # check grad weights separately, as nested dict
        for cpu_layer_weight, gpu_layer_weight in zip(outputs_cpu['weights'], outputs_gpu['weights']):
            for (cpu_weight, gpu_weight) in zip(cpu_layer_weight, gpu_layer_weight):
                NN.assertEqual(cpu_weight.grad.data, gpu_weight.grad.data, atol=5e-5, rtol=0)

    for name in ("RNN", "LSTM", "GRU"):
        module, module_gpu = getattr(nn, name), dropin(name)
        for bias, bidirectional, batch_first, contig, variable_len, lens_as_tensor \
                in product((True, False), repeat=6):

            num_directions = 2 if bidirectional else 1
            if batch_first:
                input_val = torch.randn(batch, seq_length, input_size, dtype=dtype)
                grad_output = torch.randn(batch, seq_length, hidden_size * num_directions, dtype=dtype)
            else:
                input_val = torch.randn(seq_length, batch, input_size, dtype=dtype)
                grad_output = torch.randn(seq_length, batch, hidden_size * num_directions, dtype=dtype)

            hx_val = torch.randn(num_layers * num_directions, batch, hidden_size, dtype=dtype)
            grad_hy = torch.randn(num_layers * num_directions, batch, hidden_size, dtype=dtype)

            if not contig:
                grad_output = make_noncontig(grad_output)
                grad_hy = make_noncontig(grad_hy)
                input_var = make_noncontig(input_val)  # noqa: F841  (sic, as in PyTorch)
                hx_val = make_noncontig(hx_val)

            if variable_len:
                lengths = [7, 5, 5, 2, 1, 1]
                if lens_as_tensor:
                    lengths = torch.tensor(lengths, dtype=torch.long)
                input_val = rnn_utils.pack_padded_sequence(input_val, lengths, batch_first=batch_first)
                grad_output = rnn_utils.pack_padded_sequence(grad_output, lengths, batch_first=batch_first).data

            rnn = module(input_size,
                         hidden_size,
                         num_layers,
                         bias=bias,
                         dropout=dropout,
                         bidirectional=bidirectional,
                         batch_first=batch_first).to(dtype)

            outputs_cpu = forward_backward(
                False, rnn, input_val, grad_output, rnn.all_weights, hx_val, grad_hy)

            rnn_gpu = module_gpu(input_size,
                                 hidden_size,
                                 num_layers,
                                 bias=bias,
                                 dropout=dropout,
                                 bidirectional=bidirectional,
                                 batch_first=batch_first).to(dtype)

            outputs_gpu = forward_backward(
                True, rnn_gpu, input_val, grad_output, rnn.all_weights, hx_val, grad_hy)

            compare_cpu_gpu(outputs_cpu, outputs_gpu)

    for nonlinearity in ('tanh', 'relu'):
        hx_val = torch.randn(num_layers, batch, hidden_size, dtype=dtype)
        input_val = torch.randn(seq_length, batch, input_size, dtype=dtype)
        grad_output = torch.randn(
            seq_length, batch, hidden_size * num_directions, dtype=dtype)
        grad_hy = torch.randn(
            num_layers * num_directions, batch, hidden_size, dtype=dtype)

        rnn = nn.RNN(input_size, hidden_size, num_layers, bias=bias, nonlinearity=nonlinearity).to(dtype)
        outputs_cpu = forward_backward(False, rnn, input_val, grad_output, rnn.all_weights, hx_val, grad_hy)

        rnn_gpu = dropin("RNN")(input_size, hidden_size, num_layers, bias=bias, nonlinearity=nonlinearity).to(dtype)
        outputs_gpu = forward_backward(True, rnn_gpu, input_val, grad_output, rnn.all_weights, hx_val, grad_hy)

        compare_cpu_gpu(outputs_cpu, outputs_gpu)

    # checking LSTM with projections
    for bias, bidirectional, batch_first, contig, variable_len, lens_as_tensor \
            in product((True, False), repeat=6):
        num_directions = 2 if bidirectional else 1
        if batch_first:
            input_val = torch.randn(batch, seq_length, input_size, dtype=dtype)
            grad_output = torch.randn(batch, seq_length, proj_size * num_directions, dtype=dtype)
        else:
            input_val = torch.randn(seq_length, batch, input_size, dtype=dtype)
            grad_output = torch.randn(seq_length, batch, proj_size * num_directions, dtype=dtype)

        hx_val = torch.randn(num_layers * num_directions, batch, proj_size, dtype=dtype)
        cx_val = torch.randn(num_layers * num_directions, batch, hidden_size, dtype=dtype)
        grad_hy = torch.randn(num_layers * num_directions, batch, proj_size, dtype=dtype)
        grad_cy = torch.randn(num_layers * num_directions, batch, hidden_size, dtype=dtype)

        if not contig:
            grad_output = make_noncontig(grad_output)
            grad_hy = make_noncontig(grad_hy)
            grad_cy = make_noncontig(grad_cy)
            input_var = make_noncontig(input_val)  # noqa: F841  (sic, as in PyTorch)
            hx_val = make_noncontig(hx_val)
            cx_val = make_noncontig(cx_val)

        if variable_len:
            lengths = [7, 5, 5, 2, 1, 1]
            if lens_as_tensor:
                lengths = torch.tensor(lengths, dtype=torch.long)
            input_val = rnn_utils.pack_padded_sequence(input_val, lengths, batch_first=batch_first)
            grad_output = rnn_utils.pack_padded_sequence(grad_output, lengths, batch_first=batch_first).data

        rnn = nn.LSTM(input_size,
                      hidden_size,
                      num_layers,
                      bias=bias,
                      dropout=dropout,
                      bidirectional=bidirectional,
                      batch_first=batch_first,
                      proj_size=proj_size).to(dtype)

        outputs_cpu = forward_backward(
            False, rnn, input_val, grad_output, rnn.all_weights,
            hx_val, grad_hy, cx_val, grad_cy)

        rnn_gpu = dropin("LSTM")(input_size,
                                 hidden_size,
                                 num_layers,
                                 bias=bias,
                                 dropout=dropout,
                                 bidirectional=bidirectional,
                                 batch_first=batch_first,
                                 proj_size=proj_size).to(dtype)

        outputs_gpu = forward_backward(
            True, rnn_gpu, input_val, grad_output, rnn.all_weights,
            hx_val, grad_hy, cx_val, grad_cy)
        compare_cpu_gpu(outputs_cpu, outputs_gpu)


def test_RNN_cpu_vs_cudnn_no_dropout():
    """Ports test_nn.py TestNN.test_RNN_cpu_vs_cudnn_no_dropout: torch.nn (CPU) against the drop-in."""
    dtype = torch.double
    _test_RNN_cpu_vs_cudnn(0, dtype)


def test_RNN_cpu_vs_cudnn_with_dropout():
    """Ports test_nn.py TestNN.test_RNN_cpu_vs_cudnn_with_dropout: torch.nn (CPU) against the drop-in."""
    # Because of dropout randomness, can only compare dropout=0 and dropout=1
    _test_RNN_cpu_vs_cudnn(1)


def test_RNN_cudnn_weight_norm():
    """Ports test_nn.py TestNN.test_RNN_cudnn_weight_norm without its moves to CUDA (the drop-in's CPU path is
    the one under test): weight_norm on a weight, and its removal, leave the output as it was."""
    LSTM = dropin("LSTM")
    input_size = 10
    hidden_size = 6
    num_layers = 2
    seq_length = 7
    batch = 6

    # runs on CPU to acquire expected output
    def check_weight_norm(m, name):
        input = torch.randn(seq_length, batch, input_size)
        expected_output = m(input)

        # adds weight normalization
        m = torch.nn.utils.weight_norm(m, name=name)

        # (PyTorch moves the module and the input to CUDA here)

        # otherwise, subsequent warnings will be hidden, and further tests rely on them
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            NN.assertEqual(m(input), expected_output)

            # remove weight norm
            m = torch.nn.utils.remove_weight_norm(m, name=name)
            NN.assertEqual(m(input), expected_output)

    check_weight_norm(LSTM(input_size, hidden_size, num_layers), 'weight_hh_l0')
    check_weight_norm(LSTM(input_size, hidden_size, num_layers, proj_size=3), 'weight_hr_l0')


def test_partial_flat_weights():
    """Ports test_nn.py TestNN.test_partial_flat_weights with ``.cpu()`` in place of ``.cuda()``: a module with a
    deleted weight can still be moved (Module._apply), and works again once the weight is put back."""
    LSTM = dropin("LSTM")
    input_size = 10
    hidden_size = 6
    num_layers = 2

    m = LSTM(input_size, hidden_size, num_layers)
    inp = torch.randn(3, 2, 10)
    out_expected = m(inp)
    # deletes an attribute of original LSTM
    weight_orig = m.weight_hh_l0
    del m.weight_hh_l0
    assert not hasattr(m, "weight_hh_l0")
    # verifies that moving (PyTorch: to CUDA) with only some attributes defined
    # does not throw an error
    m.cpu()
    # recompute the weight and make sure that module can be used
    m.weight_hh_l0 = weight_orig.cpu()
    inp = inp.cpu()
    # otherwise, subsequent warnings will be hidden, and further tests rely on them
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        NN.assertEqual(m(inp)[0].cpu(), out_expected[0])


def test_RNN_dropout():
    """Ports test_nn.py TestNN.test_RNN_dropout (its CPU half; PyTorch runs it where cuDNN exists)."""
    RNN = dropin("RNN")
    with set_default_dtype(torch.double):
        # checking the assumption that cuDNN sticks dropout in between
        # RNN layers
        for p in (0, 0.276, 0.731, 1):
            for train in (True, False):
                for cuda in (False,):
                    rnn = RNN(10, 1000, 2, bias=False, dropout=p, nonlinearity='relu')

                    if train:
                        rnn.train()
                    else:
                        rnn.eval()
                    rnn.weight_ih_l0.data.fill_(1)
                    rnn.weight_hh_l0.data.fill_(1)
                    rnn.weight_ih_l1.data.fill_(1)
                    rnn.weight_hh_l1.data.fill_(1)
                    input = torch.ones(1, 1, 10)
                    hx = torch.zeros(2, 1, 1000)

                    output, hy = rnn(input, hx)
                    NN.assertEqual(output.data.min(), output.data.max())
                    output_val = output.data[0][0][0]
                    if p == 0 or not train:
                        NN.assertEqual(output_val, 10000)
                    elif p == 1:
                        NN.assertEqual(output_val, 0)
                    else:
                        assert output_val > 8000
                        assert output_val < 12000
                        denorm_mod = (output_val * (1 - p)) % 10
                        assert min(denorm_mod, 10 - denorm_mod) < 1e-2

                    NN.assertEqual(hy[0].data.min(), hy[0].data.max())
                    NN.assertEqual(hy[1].data.min(), hy[1].data.max())
                    NN.assertEqual(hy.data[0][0][0], 10)
                    NN.assertEqual(hy.data[1][0][0], output_val)


def test_error_RNN_seq_len_zero():
    """Ports test_nn.py TestNN.test_error_RNN_seq_len_zero."""
    with set_default_dtype(torch.double):
        # checking error message when RNN has seq_len = 0
        for name in ("RNN", "LSTM", "GRU"):
            module = dropin(name)
            for bidirectional in [True, False]:
                for device in _devices():
                    input = torch.ones(0, 10, 5)
                    rnn = module(5, 6, bidirectional=bidirectional)
                    if device == 'cuda':
                        rnn.cuda()
                        input = input.cuda()

                    with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0 in RNN"):
                        rnn(input)


def test_RNN_input_size_zero():
    """Ports test_nn.py TestNN.test_RNN_input_size_zero (a batch of 0 sequences)."""
    for name in ("RNN", "LSTM", "GRU"):
        module = dropin(name)
        for device in _devices():
            input = torch.zeros((5, 0, 3))
            rnn = module(input_size=3, hidden_size=4)
            if device == 'cuda':
                rnn.cuda()
                input = input.cuda()
            outs = rnn(input)
            NN.assertEqual(outs[0].shape, torch.Size([5, 0, 4]))
            # Check that backward does not cause a hard error
            outs[0].sum().backward()


def test_RNN_dropout_state():
    """Ports test_nn.py TestNN.test_RNN_dropout_state (its CPU half)."""
    RNN = dropin("RNN")
    for p in (0, 0.1234):
        for train in (True, False):
            for cuda in (False,):
                rnn = RNN(100, 100, 2, bias=False, dropout=p, nonlinearity='relu')

                if train:
                    rnn.train()
                else:
                    rnn.eval()
                input = torch.rand(1, 1, 100)
                hx = torch.rand(2, 1, 100)

                output1, hy1 = rnn(input, hx)
                output2, hy2 = rnn(input, hx)

                buf = io.BytesIO()
                torch.save(rnn, buf)
                buf.seek(0)
                # weights_only=False as this is legacy code that saves the model
                rnn2 = torch.load(buf, weights_only=False)
                rnn2.flatten_parameters()
                output3, hy3 = rnn2(input, hx)

                if p == 0 or not train:
                    NN.assertEqual(output1, output2)
                    NN.assertEqual(output1, output3)
                    NN.assertEqual(hy1, hy2)
                    NN.assertEqual(hy1, hy3)
                else:
                    NN.assertNotEqual(output1, output2)
                    NN.assertNotEqual(output1, output3)
                    NN.assertNotEqual(hy1, hy2)
                    NN.assertNotEqual(hy1, hy3)


def test_RNN_change_dropout():
    """Ports test_nn.py TestNN.test_RNN_change_dropout (its CPU half)."""
    RNN = dropin("RNN")
    with set_default_dtype(torch.double):
        for train, cuda in product((True, False), (False,)):
            rnn = RNN(100, 100, 2, dropout=0, nonlinearity='relu')
            input = torch.rand(3, 2, 100)

            if train:
                rnn.train()
            else:
                rnn.eval()

            prev_output = None
            for p in (0, 0.5, 0, 0.7, 0.2, 1, 0.2, 0):
                rnn.dropout = p
                output1, hy1 = rnn(input)
                output2, hy2 = rnn(input)

                if p == 0 or p == 1 or not train:
                    NN.assertEqual(output1, output2)
                    NN.assertEqual(hy1, hy2)
                else:
                    NN.assertNotEqual(output1, output2)
                    NN.assertNotEqual(hy1, hy2)

                if prev_output is not None:
                    if not train:
                        NN.assertEqual(output1.data, prev_output)
                        NN.assertEqual(output2.data, prev_output)
                    else:
                        NN.assertNotEqual(output1.data, prev_output)
                        NN.assertNotEqual(output2.data, prev_output)
                prev_output = output1.data


def test_RNN_nonlinearity():
    """Ports test_nn.py TestNN.test_RNN_nonlinearity."""
    RNN = dropin("RNN")
    rnn = RNN(1, 10)
    NN.assertEqual(rnn.nonlinearity, 'tanh')

    rnn = RNN(1, 10, nonlinearity='relu')
    NN.assertEqual(rnn.nonlinearity, 'relu')

    with pytest.raises(ValueError, match='Unknown nonlinearity'):
        rnn = RNN(1, 10, nonlinearity='garbage')


def test_RNN_nonlinearity_passed_as_arg():
    """Ports test_nn.py TestNN.test_RNN_nonlinearity_passed_as_arg."""
    rnn = dropin("RNN")(2, 3, 1, 'relu')
    NN.assertEqual(rnn.nonlinearity, 'relu')


def test_module_apply_inplace_op():
    """Ports test_nn.py TestNN.test_module_apply_inplace_op with the drop-in LSTM in nn.Linear's place
    (``weight`` -> ``weight_ih_l0``): an in-place Module._apply bumps the parameters' and their gradients'
    version counters."""
    LSTM = dropin("LSTM")

    def add_one_inplace(t):
        return t.add_(1.0)

    # Test that applying an in-place operation to a module would bump
    # the module's parameters' version counter.
    m = LSTM(20, 10)
    pvm = m.weight_ih_l0.mul(m.weight_ih_l0)
    m_weight_version_saved = m.weight_ih_l0._version
    m = m._apply(add_one_inplace)
    assert m.weight_ih_l0._version > m_weight_version_saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pvm.backward(torch.randn(40, 20))

    # Test that applying an in-place operation to a module would bump
    # the module's parameters' gradients' version counter.
    m = LSTM(20, 10)
    m.weight_ih_l0.grad = torch.randn(40, 20).requires_grad_()
    pgm = m.weight_ih_l0.grad.mul(m.weight_ih_l0.grad)
    m_weight_grad_version_saved = m.weight_ih_l0.grad._version
    m = m._apply(add_one_inplace)
    assert m.weight_ih_l0.grad._version > m_weight_grad_version_saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pgm.backward(torch.randn(40, 20))


def test_rnn_weight_norm():
    """Ports test_nn.py TestNN.test_rnn_weight_norm."""
    LSTM = dropin("LSTM")

    def check_weight_norm(l, name, num_params):
        # This Module has 4 or 5 parameters called:
        # 'weight_ih_l0', 'weight_hh_l0', 'bias_ih_l0', 'bias_hh_l0', weight_hr_l0

        # Applying weight norm on one of them causes it to become a tensor
        l = torch.nn.utils.weight_norm(l, name=name)
        NN.assertEqual(
            sum(isinstance(p, torch.nn.Parameter) for p in l._flat_weights),
            num_params - 1,
        )

        # Removing the weight norm reparametrization restores the Parameter
        l = torch.nn.utils.remove_weight_norm(l, name=name)
        NN.assertEqual(
            sum(isinstance(p, torch.nn.Parameter) for p in l._flat_weights),
            num_params,
        )

        # Make sure that, upon removal of the reparametrization, the
        # `._parameters` and `.named_parameters` contain the right params.
        # Specifically, the original weight ('weight_ih_l0') should be placed
        # back in the parameters, while the reparametrization components
        # ('weight_ih_l0_v' and 'weight_ih_l0_g') should be removed.
        assert name in l._parameters
        assert l._parameters[name] is not None
        assert name + '_v' not in l._parameters
        assert name + '_g' not in l._parameters
        assert name in dict(l.named_parameters())
        assert dict(l.named_parameters())[name] is not None
        assert name + '_v' not in dict(l.named_parameters())
        assert name + '_g' not in dict(l.named_parameters())

    check_weight_norm(LSTM(32, 32), 'weight_ih_l0', 4)
    check_weight_norm(LSTM(32, 32, proj_size=16), 'weight_hr_l0', 5)


# ---------------------------------------------------------------------------------------------------------
# test/test_nn.py: TestNNDeviceType (device "cpu")
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
def test_rnn_fused(dtype):
    """Ports test_nn.py TestNNDeviceType.test_rnn_fused (onlyCUDA there: CPU against the fused CUDA kernels)
    with the drop-in as the "device" module: torch.nn (CPU) against numbarnn, same weights and inputs."""
    device = DEVICE

    def copy_rnn(rnn1, rnn2):
        for x_layer, y_layer in zip(rnn1.all_weights, rnn2.all_weights):
            for x, y in zip(x_layer, y_layer):
                x.data.copy_(y.data)

    def check_rnn_grads(rnn1, rnn2):
        for x_layer, y_layer in zip(rnn1.all_weights, rnn2.all_weights):
            for x, y in zip(x_layer, y_layer):
                NN.assertEqual(x.grad, y.grad, atol=5e-5, rtol=0)

    input_size = 10
    hidden_size = 6
    num_layers = 2
    seq_length = 7
    batch = 6
    input_val = torch.randn(seq_length, batch, input_size, dtype=dtype)
    grad_output = torch.randn(seq_length, batch, hidden_size, dtype=dtype)
    hx_val = torch.randn(num_layers, batch, hidden_size, dtype=dtype)
    grad_hy = torch.randn(num_layers, batch, hidden_size, dtype=dtype)
    with torch.backends.cudnn.flags(enabled=False, allow_tf32=None):
        for name in ("GRU", "LSTM"):
            module, module_device = getattr(nn, name), dropin(name)
            for bias in (True, False):
                rnn = module(input_size, hidden_size, num_layers, bias=bias).to(dtype)
                rnn_device = module_device(input_size, hidden_size, num_layers, bias=bias).to(device, dtype)
                copy_rnn(rnn, rnn_device)

                is_lstm = isinstance(rnn, nn.LSTM)
                if is_lstm:
                    hx = (hx_val.clone().requires_grad_(True),
                          hx_val.clone().add(1).requires_grad_(True))
                    hx_device = (hx_val.clone().to(device).requires_grad_(True),
                                 hx_val.clone().to(device).add(1).requires_grad_(True))
                else:
                    hx = hx_val.clone().requires_grad_(True)
                    hx_device = hx_val.clone().to(device).requires_grad_(True)

                inp = input_val.clone().requires_grad_(True)
                inp_cu = input_val.clone().to(device).requires_grad_(True)
                output1, hy1 = rnn(inp, hx)
                output2, hy2 = rnn_device(inp_cu, hx_device)
                if is_lstm:
                    torch.autograd.backward(
                        [output1, hy1[0], hy1[1]], [grad_output, grad_hy, grad_hy + 1]
                    )
                    torch.autograd.backward(
                        [output2, hy2[0], hy2[1]],
                        [grad_output.to(device), grad_hy.to(device), (grad_hy + 1).to(device)]
                    )
                else:
                    torch.autograd.backward([output1, hy1], [grad_output, grad_hy])
                    torch.autograd.backward([output2, hy2], [grad_output.to(device), grad_hy.to(device)])

                NN.assertEqual(output1, output2)
                NN.assertEqual(hy1, hy2)

                check_rnn_grads(rnn, rnn_device)
                NN.assertEqual(inp.grad, inp_cu.grad)
                if is_lstm:
                    NN.assertEqual(hx[0].grad, hx_device[0].grad)
                    NN.assertEqual(hx[1].grad, hx_device[1].grad)
                else:
                    NN.assertEqual(hx.grad, hx_device.grad)


def test_save_lstm_compatibility():
    """Ports test_nn.py TestNNDeviceType.test_save_lstm_compatibility."""
    LSTM = dropin("LSTM")
    # Test that saving an LSTM in PyTorch 1.7 and older can still be
    # loaded in newer versions of PyTorch.
    model = LSTM(2, 3)
    x = torch.randn(32, 5, 2)
    expected = model(x)

    # Get a state dict for PyTorch 1.7 LSTM. Before PyTorch 1.8, proj_size
    # didn't exist.
    assert model.proj_size == 0
    state_dict = model.__dict__
    del state_dict['proj_size']

    # load a model
    loaded_model = LSTM(2, 3)
    loaded_model.__setstate__(state_dict)
    result = loaded_model(x)
    NN.assertEqual(result, expected)


def _test_rnn_retain_variables(device, dtype):
    rnns = [dropin("LSTM")(10, 20, num_layers=2).to(device, dtype),
            dropin("GRU")(10, 20, num_layers=2).to(device, dtype),
            dropin("RNN")(10, 20, num_layers=2).to(device, dtype)]
    for rnn in rnns:
        input = torch.randn(5, 6, 10, device=device, dtype=dtype, requires_grad=True)
        output = rnn(input)
        output[0].sum().backward(retain_graph=True)
        grads = [input.grad.data.clone()] + [p.grad.data.clone() for p in rnn.parameters()]
        for _ in range(4):
            rnn.zero_grad()
            input.grad.data.zero_()
            output[0].sum().backward(retain_graph=True)
            grads2 = [input.grad.data] + [p.grad.data for p in rnn.parameters()]
            NN.assertEqual(grads, grads2)


def test_rnn_retain_variables():
    """Ports test_nn.py TestNNDeviceType.test_rnn_retain_variables (dtype double on the CPU)."""
    _test_rnn_retain_variables(DEVICE, torch.double)


def test_lstmcell_backward_only_one_output_grad():
    """Ports test_nn.py TestNNDeviceType.test_lstmcell_backward_only_one_output_grad (onlyCUDA there; nothing
    in it is CUDA-specific, so it runs on the CPU)."""
    device, dtype = DEVICE, torch.double
    # checks that undefined gradients doesn't hamper the backward
    # see #11872
    l = dropin("LSTMCell")(2, 3).to(device).to(dtype=dtype)
    s = torch.randn(1, 2, device=device, dtype=dtype, requires_grad=True)
    for i in range(2):
        out = l(s)[i]
        out.sum().backward()
        assert not (s.grad is None or s.grad.abs().sum().item() == 0)


def _test_rnn_mod(mod, inp):
    def flatten_out(mod, inp):
        out = mod(inp)
        return tuple([t if isinstance(t, torch.Tensor) else tt for t in out for tt in t])
    gradcheckfunc = lambda inp: flatten_out(mod, inp)  # noqa: E731  (PyTorch: partial(flatten_out, mod))
    with torch.backends.cudnn.flags(enabled=False):
        gradcheck(gradcheckfunc, inp, check_batched_grad=False)
        gradgradcheck(gradcheckfunc, inp, check_batched_grad=False)
    # (PyTorch's `if inp.is_cuda` branch checks cuDNN's double-backward error: LEFT_OUT)


def test_LSTM_grad_and_gradgrad():
    """Ports test_nn.py TestNNDeviceType.test_LSTM_grad_and_gradgrad (dtype double)."""
    device, dtype = DEVICE, torch.double
    hsize = 4
    inp = torch.rand(1, 3, hsize, device=device, dtype=dtype, requires_grad=True)
    for bias in [True, False]:
        mod = dropin("LSTM")(hsize, hsize, bias=bias).to(device).to(dtype)
        _test_rnn_mod(mod, inp)


def test_GRU_grad_and_gradgrad():
    """Ports test_nn.py TestNNDeviceType.test_GRU_grad_and_gradgrad (dtype double)."""
    device, dtype = DEVICE, torch.double
    hsize = 4
    inp = torch.rand(1, 3, hsize, device=device, dtype=dtype, requires_grad=True)
    for bias in [True, False]:
        mod = dropin("GRU")(hsize, hsize, bias=bias).to(device).to(dtype)
        _test_rnn_mod(mod, inp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_LSTM_differentiable_backward_using_oneDNN(dtype):
    """Ports test_nn.py TestNNDeviceType.test_LSTM_differentiable_backward_using_oneDNN (onlyCPU; as there, the
    body does not use `dtype`): the gradient of the input gradient is the same with oneDNN off and on."""
    batch = 10
    seq_len = 12
    input = 3
    Net = dropin("LSTM")(input, 3, 20, batch_first=True)
    Net_clone = copy.deepcopy(Net)  # noqa: F841
    x = torch.rand(batch, seq_len, input)
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)

    mkldnn_enabled = torch._C._get_mkldnn_enabled()
    try:
        torch._C._set_mkldnn_enabled(False)
        out1, _ = Net(x1)
        der_out1 = torch.autograd.grad(out1, x1,
                                       grad_outputs=torch.ones_like(out1),
                                       retain_graph=True,
                                       create_graph=True)[0]
        loss1 = der_out1.sum()
        loss1.backward(retain_graph=True)

        torch._C._set_mkldnn_enabled(True)
        out2, _ = Net(x2)
        der_out2 = torch.autograd.grad(out2, x2,
                                       grad_outputs=torch.ones_like(out2),
                                       retain_graph=True,
                                       create_graph=True)[0]
        loss2 = der_out2.sum()
        loss2.backward(retain_graph=True)
    finally:
        torch._C._set_mkldnn_enabled(mkldnn_enabled)
    assert torch.allclose(der_out1, der_out2)
    assert torch.allclose(x1.grad, x2.grad)


def test_variable_sequence():
    """Ports test_nn.py TestNNDeviceType.test_variable_sequence (dtype float on the CPU)."""
    device, dtype = DEVICE, torch.float
    LSTM = dropin("LSTM")

    def pad(var, length):
        if var.size(0) == length:
            return var
        return torch.cat([var, var.new_zeros(length - var.size(0), *var.size()[1:])])

    def maybe_index_tuple(maybe_tuple_of_tensors, index):
        if maybe_tuple_of_tensors is None:
            return None
        return tuple(maybe_tuple_of_tensors[j][:, index:index + 1, :].contiguous()
                     for j in range(2))

    def check_lengths(lengths, enforce_sorted, use_default_hiddens, proj_size):
        input_size = 3
        hidden_size = 4
        num_layers = 2
        bidirectional = True

        max_length = max(lengths)
        x_leaf = torch.randn(max_length, len(lengths), input_size, device=device,
                             dtype=dtype, requires_grad=True)
        num_directions = 2 if bidirectional else 1
        lstm = LSTM(input_size, hidden_size, bidirectional=bidirectional,
                    num_layers=num_layers, proj_size=proj_size).to(device, dtype)
        lstm2 = deepcopy(lstm).to(device, dtype)
        x = x_leaf

        hidden0 = None
        if not use_default_hiddens:
            real_hidden_size = hidden_size if proj_size == 0 else proj_size
            hidden0 = (torch.randn(num_directions * num_layers, len(lengths), real_hidden_size,
                                   device=device, dtype=dtype),
                       torch.randn(num_directions * num_layers, len(lengths), hidden_size,
                                   device=device, dtype=dtype))

        # Compute sequences separately
        seq_outs = []
        seq_hiddens = []
        for i, l in enumerate(lengths):
            hidden_i = maybe_index_tuple(hidden0, i)
            out, hid = lstm2(x[:l, i:i + 1], hidden_i)
            out_pad = pad(out, max_length)
            seq_outs.append(out_pad)
            seq_hiddens.append(hid)
        seq_out = torch.cat(seq_outs, 1)
        seq_hidden = tuple(torch.cat(hids, 1) for hids in zip(*seq_hiddens))

        # Use packed format
        packed = rnn_utils.pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
        packed_out, packed_hidden = lstm(packed, hidden0)
        unpacked, unpacked_len = rnn_utils.pad_packed_sequence(packed_out)

        # Check forward
        prec = dtype2prec_DONTUSE[dtype]
        NN.assertEqual(packed_hidden, seq_hidden, atol=prec, rtol=0)
        NN.assertEqual(unpacked, seq_out, atol=prec, rtol=0)
        NN.assertEqual(unpacked_len, lengths, atol=prec, rtol=0)

        # Check backward
        seq_out.sum().backward()
        grad_x = x_leaf.grad.data.clone()
        x_leaf.grad.data.zero_()
        unpacked.sum().backward()

        NN.assertEqual(x_leaf.grad, grad_x, atol=dtype2prec_DONTUSE[dtype], rtol=0)
        for p1, p2 in zip(lstm.parameters(), lstm2.parameters()):
            prec = dtype2prec_DONTUSE[dtype]
            if dtype == torch.float16:
                prec = 4e-2
            elif dtype == torch.float32:
                prec = 2e-4
            NN.assertEqual(p1.grad, p2.grad, atol=prec, rtol=0)

    tests = [
        # enforce_sorted, lengths
        [True, [5]],
        [False, [5]],
        [True, [10, 10, 6, 2, 2, 1, 1]],
        [False, [10, 10, 6, 2, 2, 1, 1]],
        [False, [2, 1, 3, 2, 10, 5, 3]],
    ]

    for enforce_sorted, seq_lens, in tests:
        for use_default_hiddens in (True, False):
            for proj_size in [0, 2]:
                check_lengths(seq_lens, enforce_sorted, use_default_hiddens, proj_size)


# ---------------------------------------------------------------------------------------------------------
# test/test_autocast.py: TestAutocastCPU
# ---------------------------------------------------------------------------------------------------------

def test_autocast_rnn():
    """Ports test_autocast.py TestAutocastCPU.test_autocast_rnn.  PyTorch runs the body only where oneDNN has
    bfloat16 kernels (torch.ops.mkldnn._is_mkldnn_bf16_supported()); the drop-in does not use oneDNN, so it always
    runs here (with NUMBARNN_PYTORCH_SUITE_TARGET=torch it is skipped where PyTorch would skip it)."""
    if TARGET == "torch" and not (torch.backends.mkldnn.is_available()
                                  and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("torch.nn's run of this test needs oneDNN's bfloat16 kernels, as in PyTorch")
    x = torch.randn(1, 2, 1)
    hx = torch.randn(2, 2, 1)
    cx = torch.randn(2, 2, 1)

    m = dropin("LSTM")(1, 1, 2).to(torch.bfloat16)

    # Raise ValueError when autocast is not enabled
    with pytest.raises(ValueError, match=r"RNN input dtype .* does not match weight dtype"):
        m(x, (hx, cx))

    # Should be able to run the below case with autocast
    with torch.amp.autocast(device_type="cpu"):
        m(x, (hx, cx))


# ---------------------------------------------------------------------------------------------------------
# test/test_modules.py: TestModule over module_db's RNN / GRU / LSTM / RNNCell / GRUCell / LSTMCell entries
# ---------------------------------------------------------------------------------------------------------

_DROPIN_OF = {"nn.RNN": "RNN", "nn.GRU": "GRU", "nn.LSTM": "LSTM",
              "nn.RNNCell": "RNNCell", "nn.GRUCell": "GRUCell", "nn.LSTMCell": "LSTMCell"}
RNN_MODULE_DB = [mi for mi in common_modules.module_db if mi.name in _DROPIN_OF]
assert sorted(mi.name for mi in RNN_MODULE_DB) == sorted(_DROPIN_OF), "module_db lacks an RNN entry"

#: test_grad / test_gradgrad sample indices (unless NUMBARNN_PYTORCH_SUITE=full) for module_db's 32 RNN, 16 GRU
#: and 32 LSTM samples (module_inputs_torch_nn_RNN_GRU / _LSTM: for each combination of constructor options in
#: itertools.product order, one sample without and one with an initial state).  Each test's two picks are
#: complementary: every option (nonlinearity, bias, batch_first, bidirectional, proj_size, initial state given)
#: is taken both ways, and test_grad's picks differ from test_gradgrad's.  Cells: all samples.
_GRAD_SAMPLES = {
    # RNN: option combination c = 8*[tanh] + 4*bias + 2*batch_first + bidirectional; sample 2c (+1 with hx)
    "nn.RNN": {"grad": (0, 31), "gradgrad": (13, 18)},
    # GRU: c = 4*bias + 2*batch_first + bidirectional
    "nn.GRU": {"grad": (0, 15), "gradgrad": (7, 8)},
    # LSTM: c = 8*bias + 4*batch_first + 2*bidirectional + [proj_size=2]
    "nn.LSTM": {"grad": (0, 31), "gradgrad": (13, 18)},
}
_SAMPLE_COUNTS = {"nn.RNN": 32, "nn.GRU": 16, "nn.LSTM": 32}


def _module_params(infos=RNN_MODULE_DB, allowed_dtypes=None, train_only=False):
    """(module_info, dtype, training) as common_modules.modules instantiates them on the CPU."""
    params = []
    for mi in infos:
        dtypes = [d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                  if d in set(mi.supported_dtypes("cpu")) and (allowed_dtypes is None or d in allowed_dtypes)]
        flags = [True] if train_only else [True, False]
        if not mi.train_and_eval_differ:
            flags = flags[:1]
        for training, dtype in product(flags, dtypes):
            test_id = f"{mi.formatted_name}-{str(dtype).replace('torch.', '')}"
            if len(flags) > 1:
                test_id += "-train_mode" if training else "-eval_mode"
            params.append(pytest.param(mi, dtype, training, id=test_id))
    return params


def _module_cls(module_info):
    return dropin(_DROPIN_OF[module_info.name])


def _assert_module_parameters_and_buffer_are(module, device, dtype):
    # Check device placement and dtype for created parameters and buffers.
    # Only verify floating point dtypes since that's what the kwarg or methods
    # such as `float()` applies to.
    if not isinstance(device, torch.device):
        device = torch.device(device)

    def _check_module(items, name, device=device, dtype=dtype):
        for item_name, item in items:
            MODULES.assertEqual(
                item.device, device,
                f'{name} {item_name} is on device {item.device} instead of the expected device {device}')
            if item.dtype.is_floating_point:
                MODULES.assertEqual(
                    item.dtype, dtype,
                    f'{name} {item_name} is of dtype {item.dtype} instead of the expected dtype {dtype}')
    _check_module(module.named_parameters(), "Parameter")
    _check_module(module.named_buffers(), "Buffer")


def _traverse_obj(obj, func):
    if isinstance(obj, (tuple, list)):
        return type(obj)(_traverse_obj(o, func) for o in obj)
    elif isgenerator(obj):
        return tuple(_traverse_obj(o, func) for o in obj)
    elif isinstance(obj, dict):
        return {name: _traverse_obj(o, func) for name, o in obj.items()}
    elif isinstance(obj, (torch.Tensor, torch.nn.Parameter)):
        return func(obj)
    else:
        return obj


def _retain_grad(obj):
    # gradients needs to be retained to check for grad. This is useful when
    # non-leafs are present in the graph.
    def inner_retain_grad(obj):
        if obj.requires_grad:
            obj.retain_grad()
    _traverse_obj(obj, inner_retain_grad)


def _get_grads(obj):
    def inner_get_grad(obj):
        if obj.requires_grad:
            return obj.grad
    return _traverse_obj(obj, inner_get_grad)


def _zero_grad(obj):
    def inner_zero_grad(obj):
        if obj.grad is not None:
            obj.grad = None
    _traverse_obj(obj, inner_zero_grad)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_forward(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_forward."""
    device = DEVICE
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)
    dtype_to_method_caller = {
        torch.float32: methodcaller("float"),
        torch.float64: methodcaller("double"),
    }
    for module_input in module_inputs:
        if module_input.forward_input is None:
            continue

        with freeze_rng_state():
            # === Instantiate the module. ===
            args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            m = module_cls(*args, **kwargs)
            m.to(device).to(dtype)
            m.train(training)

            # === Do forward pass. ===
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            outputs = m(*args, **kwargs)

            # === Compare outputs to a reference if one is specified. ===
            # TODO: Handle precision
            reference_fn = module_input.reference_fn
            if reference_fn is not None:
                ref_outputs = reference_fn(m, *args, **kwargs)
                MODULES.assertEqual(outputs, ref_outputs)

            # === Use the method call and verify the parameters and buffers ===
            if dtype in dtype_to_method_caller:
                dtype_to_method_caller[dtype](m)
                m(*args, **kwargs)
                _assert_module_parameters_and_buffer_are(m, device, dtype)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_factory_kwargs(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_factory_kwargs."""
    device = DEVICE
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)
    for module_input in module_inputs:
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

        # Check if this module creates parameters or registers buffers.
        # The mock magic here passes through to the real Parameter / register_buffer
        # logic and is only used to check call inputs.
        module_creates_params_or_buffers = False
        parameter_new = common_utils.mock_wrapper(torch.nn.Parameter.__new__)
        with patch.object(torch.nn.Parameter, '__new__', parameter_new):
            register_buffer = common_utils.mock_wrapper(torch.nn.Module.register_buffer)
            with patch.object(torch.nn.Module, 'register_buffer', register_buffer):
                m = module_cls(*args, **kwargs)
                m.train(training)

                # Check if a parameter or buffer was created with a tensor not passed to the constructor.
                constructor_tensors = common_utils.get_tensors_from(args, kwargs)
                for mock in [parameter_new.mock, register_buffer.mock]:
                    for call_args, call_kwargs in mock.call_args_list:
                        call_tensors = common_utils.get_tensors_from(call_args, call_kwargs)
                        if len(call_tensors) > 0 and not constructor_tensors.intersection(call_tensors):
                            module_creates_params_or_buffers = True
                            break

        if not module_creates_params_or_buffers:
            continue

        # Instantiate module with the factory kwargs.
        kwargs.update({
            'device': device,
            'dtype': dtype,
        })

        if issubclass(module_info.module_cls, torch.nn.modules.lazy.LazyModuleMixin):
            # Ensure device and dtype are passed to all UninitializedParameters and UninitializedBuffers.
            uninit_param_new = common_utils.mock_wrapper(torch.nn.UninitializedParameter.__new__)
            with patch.object(torch.nn.UninitializedParameter, '__new__', uninit_param_new):
                uninit_buffer_new = common_utils.mock_wrapper(torch.nn.UninitializedBuffer.__new__)
                with patch.object(torch.nn.UninitializedBuffer, '__new__', uninit_buffer_new):
                    m = module_cls(*args, **kwargs)
                    m.train(training)
                    uninit_param_new.mock.assert_has_calls(
                        [call(device=device, dtype=dtype) for _ in uninit_param_new.mock.mock_calls])
                    uninit_buffer_new.mock.assert_has_calls(
                        [call(device=device, dtype=dtype) for _ in uninit_buffer_new.mock.mock_calls])
        else:
            # Check device placement and dtype for created parameters and buffers.
            # Only verify floating point dtypes since that's what the kwarg applies to.
            m = module_cls(*args, **kwargs)
            m.train(training)
            _assert_module_parameters_and_buffer_are(m, device, dtype)


@pytest.mark.skipif(not TEST_CUDA, reason="onlyCUDA (needs a CUDA build of torch and a GPU)")
@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_multiple_device_transfer(module_info, dtype, training):  # pragma: no cover - needs CUDA
    """Ports test_modules.py TestModule.test_multiple_device_transfer (onlyCUDA)."""
    device = "cuda"
    module_cls = _module_cls(module_info)
    module_inputs_device = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                          requires_grad=False, training=training)
    module_inputs_cpu = module_info.module_inputs_func(module_info, device="cpu", dtype=dtype,
                                                       requires_grad=False, training=training)
    for module_input_device, module_input_cpu in zip(module_inputs_device, module_inputs_cpu):
        if module_input_device.forward_input is None:
            continue

        with freeze_rng_state():
            # === Instantiate the module. ===
            args, kwargs = module_input_device.constructor_input.args, module_input_device.constructor_input.kwargs
            m = module_cls(*args, **kwargs)
            m.to(device).to(dtype)
            m.train(training)

            # === Do forward pass on GPU ===
            input_device_args = module_input_device.forward_input.args
            input_device_kwargs = module_input_device.forward_input.kwargs
            m(*input_device_args, **input_device_kwargs)
            _assert_module_parameters_and_buffer_are(m, device, dtype)

            # === Move to CPU ===
            input_cpu_args = module_input_cpu.forward_input.args
            input_cpu_kwargs = module_input_cpu.forward_input.kwargs
            m.cpu()
            m(*input_cpu_args, **input_cpu_kwargs)
            _assert_module_parameters_and_buffer_are(m, "cpu", dtype)

            # === Move back to GPU and forward pass ===
            m.cuda()
            m(*input_device_args, **input_device_kwargs)
            _assert_module_parameters_and_buffer_are(m, device, dtype)

            if torch.cuda.device_count() >= 2:
                # === test cross-GPU transfer works
                def _to_device1(objs):
                    if isinstance(objs, (tuple, list)):
                        return type(objs)(_to_device1(item) for item in objs)
                    elif isinstance(objs, dict):
                        return {name: _to_device1(item) for name, item in objs.items()}
                    elif isinstance(objs, torch.Tensor):
                        return objs.cuda(1)
                    else:
                        return objs
                input_device_1_args = _to_device1(input_device_args)
                input_device_1_kwargs = _to_device1(input_device_kwargs)

                m.cuda(1)
                with torch.cuda.device(1):
                    m(*input_device_1_args, **input_device_1_kwargs)
                _assert_module_parameters_and_buffer_are(m, torch.device("cuda:1"), dtype)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_repr(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_repr."""
    device = DEVICE
    # Test module can be represented with repr and str without errors.
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)
    for module_input in module_inputs:
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        m = module_cls(*args, **kwargs)
        m.to(device).to(dtype)
        m.train(training)

        # Check that these methods do not raise errors
        m.__repr__()
        str(m)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_save_load(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_save_load."""
    device = DEVICE
    # Test that module can be pickled and unpickled.
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)
    for module_input in module_inputs:
        if module_input.forward_input is None:
            continue

        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

        with freeze_rng_state():
            # === Instantiate the module. ===
            args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            m = module_cls(*args, **kwargs)
            m.to(device).to(dtype)
            m.train(training)
            sd = m.state_dict()

            # === Do forward pass. ===
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            output = m(*args, **kwargs)

            # === Check saved/loaded module gives the same output. ===
            with tempfile.TemporaryFile() as f:
                torch.save(m, f)
                f.seek(0)
                # weights_only=False as this is a full module, not a state dict
                m_copy = torch.load(f, weights_only=False)
                output_from_copy = m_copy(*args, **kwargs)
                MODULES.assertEqual(output, output_from_copy)

            # === Check saved/loaded state_dict are the same (including weights_only load). ===
            with tempfile.TemporaryFile() as f:
                torch.save(sd, f)
                f.seek(0)
                sd_copy = torch.load(f)
                MODULES.assertEqual(sd_copy, sd)
                del sd_copy
                f.seek(0)
                sd_copy_wo = torch.load(f, weights_only=True)
                MODULES.assertEqual(sd_copy_wo, sd)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_non_contiguous_tensors(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_non_contiguous_tensors."""
    device = DEVICE
    # Check modules work with non-contiguous tensors

    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=True, training=training)

    def _make_non_contiguous(obj):
        def inner_make_non_contiguous(obj):
            # Scalar tensors can not be made non-contiguous
            if not isinstance(obj, torch.Tensor) or obj.dim() == 0:
                return obj

            out = torch.repeat_interleave(obj, 2, dim=-1)
            out = out[..., ::2].detach()
            out.requires_grad = obj.requires_grad
            return out
        return _traverse_obj(obj, inner_make_non_contiguous)

    def _can_be_noncontiguous(obj):
        if isinstance(obj, (tuple, list)):
            return any(_can_be_noncontiguous(o) for o in obj)
        elif isinstance(obj, dict):
            return any(_can_be_noncontiguous(o) for o in obj.values())
        # scalar tensors can not be non-contiguous
        if not isinstance(obj, torch.Tensor) or obj.dim() == 0:
            return False
        return True

    for module_input in module_inputs:
        if module_input.forward_input is None:
            continue

        input_args, input_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
        if not (_can_be_noncontiguous(input_args) or _can_be_noncontiguous(input_kwargs)):
            continue

        # === Instantiate the module. ===
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        m = module_cls(*args, **kwargs)
        m.to(device).to(dtype)
        m.train(training)

        _retain_grad((input_args, input_kwargs))

        # === Forward with default input
        with freeze_rng_state():
            default_output = m(*input_args, **input_kwargs)
            if isinstance(default_output, torch.Tensor):
                grad_output = default_output.clone().detach_().normal_()
                default_output.backward(grad_output, retain_graph=True)
            else:
                grad_output = tuple(_traverse_obj(o, lambda o: o.clone().detach_().normal_() if o.requires_grad
                                                  else None)
                                    for o in default_output)
                flattened_default_output = torch.utils._pytree.tree_leaves(default_output)
                flattened_grad_output = torch.utils._pytree.tree_leaves(grad_output)
                for o, g_o in zip(flattened_default_output, flattened_grad_output):
                    if (o.requires_grad):
                        o.backward(g_o, retain_graph=True)

        default_input_args_grad, default_input_kwargs_grad = deepcopy(_get_grads((input_args, input_kwargs)))
        default_param_grad = deepcopy([p.grad for p in m.parameters()])

        # === Construct non-contiguous tensors ===
        nc_input_args, nc_input_kwargs = _make_non_contiguous((input_args, input_kwargs))
        nc_grad_output = _make_non_contiguous(grad_output)

        # === Compare results with non-contiguous and contiguous tensors ===
        inputs = [(input_args, input_kwargs), (nc_input_args, nc_input_kwargs)]
        grads = [grad_output, nc_grad_output]

        for (in_args, in_kwargs), g_out in product(inputs, grads):
            g_out_copy = deepcopy(g_out)
            _zero_grad((in_args, in_kwargs))
            _zero_grad(m.parameters())

            with freeze_rng_state():
                out = m(*in_args, **in_kwargs)
                if isinstance(out, torch.Tensor):
                    out.backward(g_out_copy, retain_graph=True)
                else:
                    flattened_out = torch.utils._pytree.tree_leaves(out)
                    flattened_g_out_copy = torch.utils._pytree.tree_leaves(g_out_copy)
                    for o, g_o in zip(flattened_out, flattened_g_out_copy):
                        if o.requires_grad:
                            o.backward(g_o, retain_graph=True)

            input_args_grad, input_kwargs_grad = _get_grads((in_args, in_kwargs))
            MODULES.assertEqual(out, default_output)
            MODULES.assertEqual(input_args_grad, default_input_args_grad, atol=1e-4, rtol=0)
            MODULES.assertEqual(input_kwargs_grad, default_input_kwargs_grad, atol=1e-4, rtol=0)

            param_grad = [p.grad for p in m.parameters()]
            MODULES.assertEqual(param_grad, default_param_grad)


def _grad_samples(module_info, module_inputs, which):
    module_inputs = list(module_inputs)
    picks = _GRAD_SAMPLES.get(module_info.name)
    if FULL or picks is None:
        return module_inputs
    assert len(module_inputs) == _SAMPLE_COUNTS[module_info.name], \
        f"module_db's {module_info.name} samples changed: revise _GRAD_SAMPLES"
    return [module_inputs[i] for i in picks[which]]


def _test_gradients_helper(device, dtype, module_info, training, check, which):
    # Check gradients
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=True, training=training)
    # === Set nondet tol for gradcheck to user-defined value if on CUDA and cudNN is enabled
    gradcheck_nondet_tol = 0.0
    if torch.device(device).type == 'cuda' and torch.backends.cudnn.enabled:
        gradcheck_nondet_tol = module_info.gradcheck_nondet_tol

    for module_input in _grad_samples(module_info, module_inputs, which):
        if module_input.forward_input is None:
            continue

        # === Instantiate the module. ===
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        m = module_cls(*args, **kwargs)
        m.to(device).to(dtype)
        m.train(training)

        params = tuple(m.parameters())

        # === Lazy modules need to see an input to initialize params before gradcheck is run. ===
        input_args, input_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
        if issubclass(module_info.module_cls, torch.nn.modules.lazy.LazyModuleMixin):
            with torch.no_grad():
                m(*input_args, **input_kwargs)

        # === Perform gradient check on the input_args ===
        other_kwargs = {}
        kwarg_tensors = []
        for name, obj in input_kwargs.items():
            if isinstance(obj, torch.Tensor):
                kwarg_tensors.append((name, obj))
            else:
                other_kwargs[name] = obj

        def fn_to_gradcheck(*flat_input_and_params):
            input_and_params = torch.utils._pytree.tree_unflatten(flat_input_and_params, flat_spec)
            new_input_args = input_and_params[:len(input_args)]
            kwarg_args = input_and_params[-len(kwarg_tensors):]
            new_kwargs = {name: obj for (name, _), obj in zip(kwarg_tensors, kwarg_args)}

            with freeze_rng_state():
                output = m(*new_input_args, **new_kwargs, **other_kwargs)
                output_flattened = torch.utils._pytree.tree_leaves(output)
                return output_flattened

        def do_check(flat_input):
            assert check(
                fn_to_gradcheck,
                flat_input,
                nondet_tol=gradcheck_nondet_tol,
                fast_mode=module_info.gradcheck_fast_mode
            )

        # check total derivative
        grad_input = input_args + params + tuple(obj for (_, obj) in kwarg_tensors)
        flat_input, flat_spec = torch.utils._pytree.tree_flatten(grad_input)
        do_check(flat_input)

        # check partial derivatives
        old_params_requires_grad = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad = False

        old_kwargs_requires_grad = [obj.requires_grad for (_, obj) in kwarg_tensors]
        for (_, obj) in kwarg_tensors:
            obj.requires_grad = False

        for p, old in zip(params, old_params_requires_grad):
            p.requires_grad = old
            grad_input = input_args + params + tuple(obj for (_, obj) in kwarg_tensors)
            flat_input, flat_spec = torch.utils._pytree.tree_flatten(grad_input)
            do_check(flat_input)
            p.requires_grad = False

        for (_, obj), old in zip(kwarg_tensors, old_kwargs_requires_grad):
            obj.requires_grad = old
            grad_input = input_args + params + tuple(obj for (_, obj) in kwarg_tensors)
            flat_input, flat_spec = torch.utils._pytree.tree_flatten(grad_input)
            do_check(flat_input)
            obj.requires_grad = False


@pytest.mark.parametrize("module_info,dtype,training", _module_params(allowed_dtypes=[torch.double]))
def test_grad(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_grad (RNN/GRU/LSTM: the samples of _GRAD_SAMPLES unless
    NUMBARNN_PYTORCH_SUITE=full)."""
    _test_gradients_helper(DEVICE, dtype, module_info, training, gradcheck, "grad")


@pytest.mark.parametrize("module_info,dtype,training",
                         _module_params([m for m in RNN_MODULE_DB if m.supports_gradgrad],
                                        allowed_dtypes=[torch.double]))
def test_gradgrad(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_gradgrad (RNN/GRU/LSTM: the samples of _GRAD_SAMPLES unless
    NUMBARNN_PYTORCH_SUITE=full)."""
    _test_gradients_helper(DEVICE, dtype, module_info, training, gradgradcheck, "gradgrad")


@pytest.mark.skipif(not TEST_CUDA, reason="onlyCUDA (needs a CUDA build of torch and a GPU)")
@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_cpu_gpu_parity(module_info, dtype, training):  # pragma: no cover - needs CUDA
    """Ports test_modules.py TestModule.test_cpu_gpu_parity (onlyCUDA; tolerances float32 5e-2, float64 4e-4).
    PyTorch returns early for RNN/GRU/LSTM in eval mode when cuDNN is enabled (cuDNN has no backward in eval
    mode); that does not apply to the drop-ins, which always run."""
    device = "cuda"
    atol = {torch.float32: 5e-2, torch.float64: 4e-4}[dtype]
    tc = _assertions(atol, 0.0)

    # Test cpu and gpu results are the same
    module_cls = _module_cls(module_info)
    module_inputs_cpu = module_info.module_inputs_func(module_info, device="cpu", dtype=dtype,
                                                       requires_grad=True, training=training)

    def _to_device(obj):
        if isinstance(obj, torch.Tensor):
            res = obj.detach().to(device=device)
            res.requires_grad = obj.requires_grad
            return res
        elif isinstance(obj, tuple):
            return tuple(_to_device(o) for o in obj)
        elif isinstance(obj, dict):
            return {key: _to_device(o) for key, o in obj.items()}
        else:
            return deepcopy(obj)

    for module_input in module_inputs_cpu:
        # === Move input from cpu to device ===
        cpu_forward_args = module_input.forward_input.args
        cpu_forward_kwargs = module_input.forward_input.kwargs

        gpu_forward_args, gpu_forward_kwargs = _to_device((cpu_forward_args, cpu_forward_kwargs))

        _retain_grad((cpu_forward_args, cpu_forward_kwargs, gpu_forward_args, gpu_forward_kwargs))

        # === Construct module on cpu and gpu ===
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

        cpu_module = module_cls(*args, **kwargs).to(dtype).to("cpu")
        cpu_module.train(training)
        gpu_module = module_cls(*args, **kwargs).to(dtype).to(device)
        gpu_module.train(training)

        for cpu_p, gpu_p in zip(cpu_module.parameters(), gpu_module.parameters()):
            gpu_p.data.copy_(cpu_p)

        # === Compare forward output between cpu and gpu ===
        cpu_outputs = cpu_module(*cpu_forward_args, **cpu_forward_kwargs)
        gpu_outputs = gpu_module(*gpu_forward_args, **gpu_forward_kwargs)

        tc.assertEqual(cpu_outputs, gpu_outputs)

        # === Run backwards on CPU and GPU and compare results ===
        def check_backward(cpu_output, gpu_output):
            cpu_grad_output = cpu_output.clone().normal_()
            gpu_grad_output = cpu_grad_output.type_as(gpu_output)

            cpu_output.backward(cpu_grad_output, retain_graph=True)
            gpu_output.backward(gpu_grad_output, retain_graph=True)

            cpu_grad_input = _get_grads(cpu_forward_args)
            gpu_grad_input = _get_grads(gpu_forward_args)
            tc.assertEqual(cpu_grad_input, gpu_grad_input)

            for cpu_p, gpu_p in zip(cpu_module.parameters(), gpu_module.parameters()):
                tc.assertEqual(cpu_p.grad, gpu_p.grad)

            cpu_grad_kwarg_input = _get_grads(cpu_forward_kwargs)
            gpu_grad_kwarg_input = _get_grads(gpu_forward_kwargs)
            tc.assertEqual(cpu_grad_kwarg_input, gpu_grad_kwarg_input)

        for _ in range(5):
            if isinstance(cpu_outputs, torch.Tensor):
                check_backward(cpu_outputs, gpu_outputs)
            else:
                flatten_cpu_outputs = torch.utils._pytree.tree_leaves(cpu_outputs)
                flatten_gpu_outputs = torch.utils._pytree.tree_leaves(gpu_outputs)
                for cpu_output, gpu_output in zip(flatten_cpu_outputs, flatten_gpu_outputs):
                    if cpu_output.requires_grad:
                        check_backward(cpu_output, gpu_output)


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_memory_format(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_memory_format (on the CPU: atol = rtol = None)."""
    device = DEVICE
    atol, rtol = (None, None)
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=True, training=training)
    module_memformat_affects_out = module_info.module_memformat_affects_out

    def _get_mem_formats(channels_last=False, channels_last_3d=False):
        if channels_last:
            return ([torch.contiguous_format, torch.channels_last],
                    [torch.preserve_format, torch.contiguous_format, torch.channels_last])
        elif channels_last_3d:
            return ([torch.contiguous_format, torch.channels_last_3d],
                    [torch.preserve_format, torch.contiguous_format, torch.channels_last_3d])
        else:
            return ([torch.contiguous_format],
                    [torch.preserve_format, torch.contiguous_format])

    # Check that at least one Tensor input has dim == n
    def _check_dims(obj, n):
        if isinstance(obj, torch.Tensor):
            return obj.dim() == n
        elif isinstance(obj, (tuple, list)):
            return any(_check_dims(o, n) for o in obj)
        else:
            return False

    # Called after _check_dims, when we know that >= 1 tensor can be converted to mem_format
    def _to_mem_format(mem_format, obj):
        def inner_to_mem_format(obj):
            d = obj.dim()
            if ((mem_format == torch.channels_last and d != 4)
               or (mem_format == torch.channels_last_3d and d != 5)):
                return obj.clone().detach().requires_grad_(obj.requires_grad)
            return obj.clone().to(memory_format=mem_format).detach().requires_grad_(obj.requires_grad)

        return _traverse_obj(obj, inner_to_mem_format)

    def _check_out_mem_format(output, input_mem_format, module_mem_format):
        def inner_check_out_mem_format(output):
            d = output.dim()
            if (d == 4 and ((input_mem_format == torch.channels_last)
                            or (module_mem_format == torch.channels_last and module_memformat_affects_out))):
                assert output.is_contiguous(memory_format=torch.channels_last)
            elif (d == 5 and ((input_mem_format == torch.channels_last_3d)
                              or (module_mem_format == torch.channels_last_3d and module_memformat_affects_out))):
                assert output.is_contiguous(memory_format=torch.channels_last_3d)
            else:
                assert output.is_contiguous()
        return _traverse_obj(output, inner_check_out_mem_format)

    def _req_grad(t):
        return isinstance(t, torch.Tensor) and t.requires_grad

    for module_input in module_inputs:
        if module_input.forward_input is None:
            continue

        supports_channels_last = _check_dims(module_input.forward_input.args, 4)
        supports_channels_last_3d = _check_dims(module_input.forward_input.args, 5)
        input_mem_formats, module_mem_formats = _get_mem_formats(supports_channels_last, supports_channels_last_3d)

        with freeze_rng_state():
            # === Instantiate the module. ===
            args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

            m = module_cls(*args, **kwargs)
            m.to(device).to(dtype)
            m.train(training)

            # === Get output in (contiguous, contiguous) configuration. ===
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            desired_outputs = m(*args, **kwargs)
            # === Do backward pass. ===
            ref_diff_outputs = tuple(t for t in torch.utils._pytree.tree_leaves(desired_outputs) if _req_grad(t))
            if training and len(ref_diff_outputs) > 0:
                params = tuple(p for p in m.parameters())
                ref_diff_inputs = tuple(
                    t
                    for t in torch.utils._pytree.tree_leaves((args, kwargs, params))
                    if _req_grad(t)
                )
                ref_grad_outputs = tuple(
                    torch.rand_like(t)
                    for t in ref_diff_outputs
                )
                ref_grad_inputs = torch.autograd.grad(
                    ref_diff_outputs,
                    ref_diff_inputs,
                    grad_outputs=ref_grad_outputs,
                )

            for input_mem_format in input_mem_formats:
                # === Change memformat of input. ===
                d_args = _to_mem_format(input_mem_format, module_input.forward_input.args)
                d_kwargs = _to_mem_format(input_mem_format, module_input.forward_input.kwargs)

                # See https://github.com/pytorch/pytorch/issues/107861
                # When inductor tests are turned on, the setting of requires_grad will be lost
                for t1, t2 in zip(
                    torch.utils._pytree.tree_leaves(d_args),
                    torch.utils._pytree.tree_leaves(module_input.forward_input.args),
                ):
                    t1.requires_grad_(t2.requires_grad)
                for t1, t2 in zip(
                    torch.utils._pytree.tree_leaves(d_kwargs),
                    torch.utils._pytree.tree_leaves(module_input.forward_input.kwargs),
                ):
                    t1.requires_grad_(t2.requires_grad)

                module_input.forward_input.args = d_args
                module_input.forward_input.kwargs = d_kwargs

                for module_mem_format in module_mem_formats:
                    # === Change memformat of module ===
                    m.to(memory_format=module_mem_format)

                    # === Do forward pass. ===
                    args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
                    outputs = m(*args, **kwargs)

                    # === Compare outputs to (contiguous, contiguous) output. ===
                    if input_mem_format != torch.contiguous_format or module_mem_format != torch.contiguous_format:
                        MODULES.assertEqual(outputs, desired_outputs, rtol=rtol, atol=atol)

                    # === Check mem format of output. ===
                    _check_out_mem_format(outputs, input_mem_format, module_mem_format)

                    # === Do backward pass. ===
                    diff_outputs = tuple(t for t in torch.utils._pytree.tree_leaves(outputs) if _req_grad(t))
                    if training and len(diff_outputs) > 0:
                        params = tuple(p for p in m.parameters())
                        diff_inputs = tuple(
                            t
                            for t in torch.utils._pytree.tree_leaves((args, kwargs, params))
                            if _req_grad(t)
                        )
                        grad_outputs = tuple(
                            torch.empty_like(t1).copy_(t2)
                            for (t1, t2) in zip(diff_outputs, ref_grad_outputs)
                        )

                        grad_inputs = torch.autograd.grad(
                            diff_outputs,
                            diff_inputs,
                            grad_outputs=grad_outputs,
                        )

                        if (
                            input_mem_format != torch.contiguous_format
                            or module_mem_format != torch.contiguous_format
                        ):
                            MODULES.assertEqual(
                                grad_inputs, ref_grad_inputs, rtol=rtol, atol=atol
                            )

                        # === Check mem format of grad_inputs. ===
                        _check_out_mem_format(grad_inputs, input_mem_format, module_mem_format)


@pytest.mark.parametrize("module_info,dtype,training", _module_params(train_only=True))
def test_if_train_and_eval_modes_differ(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_if_train_and_eval_modes_differ."""
    device = DEVICE
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)

    # Run forward inputs through to see if the training flag is accessed during forward.
    for module_input in module_inputs:
        if module_input.forward_input is None:
            continue

        # === Instantiate the module. ===
        args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        m = module_cls(*args, **kwargs)
        m.to(device).to(dtype)
        m.train(training)

        # Remove training attribute and see if forward still works.
        delattr(m, 'training')

        # === Do forward pass. ===
        try:
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            m(*args, **kwargs)
        except AttributeError as e:
            if "'training'" in str(e):
                assert module_info.train_and_eval_differ, (
                    f"The ModuleInfo entry for {module_info.name} has "
                    "train_and_eval_differ=False, but the training mode was found to "
                    "affect the forward pass. Consider setting train_and_eval_differ=True "
                    "for this ModuleInfo entry.")
            else:
                raise e


@pytest.mark.parametrize("module_info,dtype,training", _module_params())
def test_device_ctx_init(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_device_ctx_init (onlyCPU)."""
    device = DEVICE
    module_cls = _module_cls(module_info)
    module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                   requires_grad=False, training=training)
    with torch.device('meta'):
        module_inputs_meta = module_info.module_inputs_func(module_info, device=None, dtype=dtype,
                                                            requires_grad=False, training=training)

    for module_input, module_input_meta in zip(module_inputs, module_inputs_meta):
        c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

        c_args_meta, c_kwargs_meta = (module_input_meta.constructor_input.args,
                                      module_input_meta.constructor_input.kwargs)

        m_cpu = module_cls(*c_args, **c_kwargs)

        with torch.device('meta'):
            m = module_cls(*c_args_meta, **c_kwargs_meta)

        for (p_meta, p_cpu) in chain(zip(m.parameters(), m_cpu.parameters()),
                                     zip(m.buffers(), m_cpu.buffers())):
            if torch.nn.parameter.is_lazy(p_meta):
                continue
            assert p_meta.is_meta
            assert_metadata_eq(MODULES.assertEqual, p_meta, p_cpu)


@pytest.mark.parametrize("module_info,dtype,training",
                         _module_params([m for m in RNN_MODULE_DB if m.module_error_inputs_func is not None]))
def test_errors(module_info, dtype, training):
    """Ports test_modules.py TestModule.test_errors: every error input of module_db's module_error_inputs_func
    raises its error type with a message matching its regex.  (All error inputs are tried; the failure message
    lists each one that did not raise as PyTorch expects.)"""
    device = DEVICE
    module_cls = _module_cls(module_info)
    error_inputs = module_info.module_error_inputs_func(module_info, device=device, dtype=dtype,
                                                        requires_grad=False, training=training)
    failures = []
    for error_input in error_inputs:
        module_input = error_input.module_error_input
        c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
        what = (f"{error_input.error_on.name} of {module_cls.__name__}{_describe(c_args, c_kwargs)}"
                + ("" if module_input.forward_input is None else
                   f" called with {_describe(module_input.forward_input.args, module_input.forward_input.kwargs)}")
                + f": expected {error_input.error_type.__name__} matching {error_input.error_regex!r}")
        try:
            if error_input.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    m = module_cls(*c_args, **c_kwargs)
            elif error_input.error_on == ModuleErrorEnum.FORWARD_ERROR:
                m = module_cls(*c_args, **c_kwargs)
                fw_args, fw_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
                with pytest.raises(error_input.error_type, match=error_input.error_regex):
                    m(*fw_args, **fw_kwargs)
            else:
                raise NotImplementedError(f"Unknown error type {error_input.error_on}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - pytest's Failed is a BaseException
            failures.append(f"{what}; got {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {len(error_inputs)} error inputs failed:\n" + "\n".join(failures)


def _describe(args, kwargs) -> str:
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"<{str(a.dtype).replace('torch.', '')} tensor {tuple(a.shape)}>"
        if isinstance(a, (tuple, list)):
            return "(" + ", ".join(one(x) for x in a) + ")"
        return repr(a)
    return "(" + ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) + ")"


@contextlib.contextmanager
def _swap_tensors_test():
    """common_utils.wrapSwapTensorsTest: the swap flag is restored after the test."""
    old = torch.__future__.get_swap_module_params_on_conversion()
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)


@pytest.mark.parametrize("set_grad", [True, False], ids=["set_grad", "no_grad"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "no_swap"])
@pytest.mark.parametrize("module_info,dtype,training", _module_params(allowed_dtypes=[torch.float32]))
def test_to(module_info, dtype, training, swap, set_grad):
    """Ports test_modules.py TestModule.test_to."""
    device = DEVICE
    with _swap_tensors_test():
        module_cls = _module_cls(module_info)
        devices = ['cpu']
        if TEST_CUDA:
            devices += ['cuda']
        dtypes = module_info.dtypes
        module_inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                       requires_grad=False, training=training)
        torch.__future__.set_swap_module_params_on_conversion(swap)

        for module_input in module_inputs:
            c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs

            m = module_cls(*c_args, **c_kwargs)

            # Avoid using `module.to()` when constructing module since that is the method we are testing
            def _to(m, set_grad=False):
                for c in m.children():
                    _to(c, set_grad=set_grad)
                for n, p in m.named_parameters(recurse=False):
                    new_p = torch.nn.Parameter(p.detach().clone().to(device, dtype))
                    setattr(m, n, new_p)
                    if set_grad:
                        new_p.grad = torch.randn_like(new_p)
                for n, b in m.named_buffers(recurse=False):
                    new_b = b.detach().clone().to(device, dtype)
                    setattr(m, n, new_b)
            _to(m, set_grad=set_grad)

            # Check .to() can be run after forward and backward with swap
            has_params = len(list(m.parameters())) > 0
            if swap and not set_grad and has_params:
                out = m(*args, **kwargs)
                if isinstance(out, tuple):
                    out = out[0]
                out.sum().backward()
                m.to(dtype=torch.half)
                # reset
                m.to(dtype=torch.float32)

            prev_device, prev_dtype = device, dtype
            for device_, dtype_ in product(devices, dtypes):
                # if device/dtype do not change, grad.to(device, dtype) is a no-op so
                # swapping will not change ._cdata
                # parameters will be wrapped in an nn.Parameter before swapping
                # which will cause the ._cdata to change
                g_no_swap = device_ == prev_device and dtype_ == prev_dtype
                prev_device, prev_dtype = device_, dtype_

                p_ids_before = [id(p) for p in m.parameters()]
                p_cdatas_before = [p._cdata for p in m.parameters()]
                if set_grad:
                    g_ids_before = [id(p.grad) for p in m.parameters()]
                    g_cdatas_before = [p.grad._cdata for p in m.parameters()]

                m.to(device=device_, dtype=dtype_)

                assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
                assert all(p.device.type == device_ for p in m.parameters())
                assert all(p.dtype == dtype_ for p in m.parameters())
                p_ids_after = [id(p) for p in m.parameters()]
                p_cdatas_after = [p._cdata for p in m.parameters()]

                if set_grad:
                    assert all(p.grad.device.type == device_ for p in m.parameters())
                    assert all(p.grad.dtype == dtype_ for p in m.parameters())
                    g_ids_after = [id(p.grad) for p in m.parameters()]
                    g_cdatas_after = [p.grad._cdata for p in m.parameters()]

                if swap:
                    # id same, ._cdata differs --> swapped cdata of THPVariable
                    assert all(a == b for a, b in zip(p_ids_before, p_ids_after))
                    assert all(a != b for a, b in zip(p_cdatas_before, p_cdatas_after))
                    if set_grad:
                        assert all(a == b if g_no_swap else a != b for a, b in zip(g_cdatas_before, g_cdatas_after))
                else:
                    # id and _cdata remain the same --> .data setting
                    assert all(a == b for a, b in zip(p_cdatas_before, p_cdatas_after))
                    assert all(a == b for a, b in zip(p_ids_before, p_ids_after))
                    if set_grad:
                        assert all(a == b for a, b in zip(g_cdatas_before, g_cdatas_after))
                        assert all(a == b for a, b in zip(g_ids_before, g_ids_after))


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "no_swap"])
@pytest.mark.parametrize("module_info,dtype,training", _module_params(allowed_dtypes=[torch.float32]))
def test_to_empty(module_info, dtype, training, swap):
    """Ports test_modules.py TestModule.test_to_empty."""
    device = DEVICE
    with _swap_tensors_test():
        module_cls = _module_cls(module_info)

        with torch.device("meta"):
            module_inputs = module_info.module_inputs_func(module_info, device=None, dtype=dtype,
                                                           requires_grad=False, training=training)

        torch.__future__.set_swap_module_params_on_conversion(swap)
        device_ = torch.device(device)

        for module_input in module_inputs:
            c_args, c_kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs

            with torch.device("meta"):
                m = module_cls(*c_args, **c_kwargs)

            p_ids_before = [id(p) for p in m.parameters()]
            p_cdatas_before = [p._cdata for p in m.parameters()]
            m.to_empty(device=device_)

            assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
            assert all(p.device == device_ for p in m.parameters())
            assert all(p.dtype == dtype for p in m.parameters())
            p_ids_after = [id(p) for p in m.parameters()]
            p_cdatas_after = [p._cdata for p in m.parameters()]

            if swap:
                # id same, ._cdata differs --> swapped cdata of THPVariable
                assert all(a == b for a, b in zip(p_ids_before, p_ids_after))
                assert all(a != b for a, b in zip(p_cdatas_before, p_cdatas_after))
            else:
                # id and ._cdata differ
                # meta and device have different shallow copy types, so this will create a new
                # parameter and assign it to the module
                assert all(a != b for a, b in zip(p_ids_before, p_ids_after))
                assert all(a != b for a, b in zip(p_cdatas_before, p_cdatas_after))

"""numbarnn.torch with CUDA tensors on a real GPU (skipped without one): the kernels reached zero-copy, against
torch.nn with cuDNN on the same GPU: outputs and gradients, packed input, a non-default torch stream,
torch.compile, double backward, bfloat16.  (`bash bench/gpu_run.sh tests` runs this file on a lent GPU.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

from numbarnn.torch import GRU, LSTM, LSTMCell  # noqa: E402

F64 = torch.float64
DEV = "cuda"


def pair(cls, ref_cls, dtype=F64, **kw):
    ours = cls(3, 5, dtype=dtype, device=DEV, **kw)
    ref = ref_cls(3, 5, dtype=dtype, device=DEV, **kw)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def outputs_and_grads(module, x, packed_lengths=None):
    x = x.detach().clone().requires_grad_()
    inp = x if packed_lengths is None else pack_padded_sequence(x, packed_lengths, enforce_sorted=False)
    out, final = module(inp)
    if packed_lengths is not None:
        out = pad_packed_sequence(out)[0]
    finals = final if isinstance(final, tuple) else (final,)
    loss = (out * torch.linspace(-1, 1, out.numel(), device=DEV, dtype=out.dtype).view_as(out)).sum() + \
        sum((f * f).sum() for f in finals)
    grads = torch.autograd.grad(loss, [x, *module.parameters()])
    return [out, *finals, *grads]


@pytest.mark.parametrize("cls, ref_cls, kw", [(LSTM, torch.nn.LSTM, dict(num_layers=2, bidirectional=True,
                                                                         proj_size=2)),
                                             (GRU, torch.nn.GRU, dict(num_layers=2, batch_first=False))])
def test_cuda_tensors_match_cudnn(cls, ref_cls, kw):
    ours, ref = pair(cls, ref_cls, **kw)
    x = torch.randn(6, 4, 3, dtype=F64, device=DEV)
    for lengths in (None, torch.tensor([6, 2, 5, 1])):
        got, want = outputs_and_grads(ours, x, lengths), outputs_and_grads(ref, x, lengths)
        for a, b in zip(got, want):
            assert a.device.type == "cuda"
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_non_default_stream():
    """Work queued on torch's current stream before the call is seen by the kernels, and their results by the
    work queued after it (no host synchronisation in between)."""
    ours, ref = pair(LSTM, torch.nn.LSTM, num_layers=2)
    stream = torch.cuda.Stream()
    x = torch.randn(50, 8, 3, dtype=F64, device=DEV)
    want = ref(x * 2.0)[0] + 1.0
    with torch.cuda.stream(stream):
        big = x * 2.0                              # queued on `stream`, read by numbarnn's kernels
        got = ours(big)[0] + 1.0                   # numbarnn's output read on `stream`
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_compile_and_double_backward_on_cuda():
    ours, ref = pair(LSTM, torch.nn.LSTM, num_layers=2)
    x = torch.randn(5, 3, 3, dtype=F64, device=DEV)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x)[0], ref(x)[0], rtol=1e-9, atol=1e-11)
    grads = []
    for module in (ours, ref):
        xs = x.clone().requires_grad_()
        with torch.backends.cudnn.flags(enabled=False):    # cuDNN has no double backward: torch.nn's own kernels
            (g,) = torch.autograd.grad(module(xs)[0].pow(2).sum(), xs, create_graph=True)
        grads.append(torch.autograd.grad(g.pow(2).sum(), xs)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-10)


def test_compile_with_inductor_on_cuda():
    """torch.compile's default backend (inductor: Triton kernels around the custom operator), training: outputs and
    gradients against torch.nn."""
    ours, ref = pair(LSTM, torch.nn.LSTM, num_layers=2)
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(5, 3, 3, dtype=F64, device=DEV)
    for a, b in zip(outputs_and_grads(compiled, x), outputs_and_grads(ref, x)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_bfloat16_and_cell_on_cuda():
    ours = GRU(3, 5, num_layers=2, device=DEV, dtype=torch.bfloat16)
    y, h = ours(torch.randn(4, 2, 3, device=DEV, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.device.type == "cuda" and torch.isfinite(y.float()).all()
    cell = LSTMCell(3, 5, device=DEV, dtype=F64)
    ref = torch.nn.LSTMCell(3, 5, device=DEV, dtype=F64)
    ref.load_state_dict(cell.state_dict())
    x = torch.randn(2, 3, dtype=F64, device=DEV)
    for a, b in zip(cell(x), ref(x)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)

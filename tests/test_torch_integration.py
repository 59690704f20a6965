"""numbarnn.torch inside PyTorch's machinery: the custom operators (opcheck), torch.compile with fullgraph,
torch.export, the meta device, torch.func (vmap, grad, jacrev, jacfwd, hessian, batched gradcheck), bfloat16 and
torch.autocast.  Each against torch.nn where torch.nn can do the same."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numbarnn.torch import GRU, LSTM, RNN, rnn_op  # noqa: E402

F64 = torch.float64
KINDS = {"lstm": (LSTM, torch.nn.LSTM, {}), "lstm_proj": (LSTM, torch.nn.LSTM, {"proj_size": 2}),
         "gru": (GRU, torch.nn.GRU, {}), "rnn_relu": (RNN, torch.nn.RNN, {"nonlinearity": "relu"})}


def pair(kind, dtype=F64, **kw):
    ours_cls, torch_cls, extra = KINDS[kind]
    ours = ours_cls(3, 4, **extra, **kw, dtype=dtype)
    ref = torch_cls(3, 4, **extra, **kw, dtype=dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


# ---------------------------------------------------------------------------------------------------
# the operator
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lstm", [True, False])
def test_opcheck(lstm):
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration, faithful dispatch."""
    ours, _ = pair("lstm_proj" if lstm else "gru", num_layers=2, bidirectional=True)
    x = torch.randn(4, 3, 3, dtype=F64, requires_grad=True)
    P = ours.proj_size or ours.hidden_size
    h0 = torch.randn(4, 3, P, dtype=F64, requires_grad=True)
    c0 = torch.randn(4, 3, 4, dtype=F64, requires_grad=True) if lstm else None
    net = ("lstm" if lstm else "gru", 2, 4, 3, True, ours.proj_size, True, 0.0, True, "", 0.0)
    args = (x, h0, c0, list(ours.parameters()), [4, 2, 3], torch.zeros(2, dtype=torch.int64), *net)
    torch.library.opcheck(rnn_op, args)


def test_the_reserve_gets_no_gradient_and_unused_outputs_none(monkeypatch):
    """The reserve output is not differentiable, and the backward is not handed materialised zero gradients for
    outputs the loss does not use (autograd allocated one as large as the reserve at every backward); the
    gradients of a loss on y alone, or on h_n alone, still match torch.nn's."""
    from numbarnn import torch_ops

    ours, ref = pair("lstm_proj", num_layers=2, bidirectional=True)
    x = torch.randn(4, 3, 3, dtype=F64, requires_grad=True)
    P = ours.proj_size
    state = (torch.randn(4, 3, P, dtype=F64), torch.randn(4, 3, 4, dtype=F64))
    net = ("lstm", 2, 4, 3, True, P, True, 0.0, True, "", 0.0)
    out = rnn_op(x, *state, list(ours.parameters()), None, torch.zeros(2, dtype=torch.int64), *net)
    assert [o.requires_grad for o in out] == [True, True, True, False]
    seen = []
    real = torch_ops._grads
    monkeypatch.setattr(torch_ops, "_grads", lambda ctx, *g: (seen.append(g), real(ctx, *g))[1])
    monkeypatch.setattr(type(ours), "_fast", lambda *a: None)   # the general path (the fast path's own test:
    #                                                              test_tiny_calls.py)
    for pick in (lambda y, s: y.sum(), lambda y, s: s[0].square().sum()):
        grads = []
        for m in (ours, ref):
            xg = x.detach().clone().requires_grad_(True)
            y, s = m(xg, state)
            pick(y, s).backward()
            grads.append([xg.grad] + [p.grad.clone() for p in m.parameters()])
            m.zero_grad()
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert seen[0][1] is None and seen[0][2] is None and seen[1][0] is None   # unused outputs: None


# ---------------------------------------------------------------------------------------------------
# torch.compile, torch.export, the meta device
# ---------------------------------------------------------------------------------------------------

class LanguageModel(torch.nn.Module):
    """embedding -> 2-layer LSTM -> linear, the issue's model."""

    def __init__(self, lstm_cls, V=11, E=6, H=8, dropout=0.0):
        super().__init__()
        self.emb = torch.nn.Embedding(V, E)
        self.rnn = lstm_cls(E, H, 2, dropout=dropout)
        self.out = torch.nn.Linear(H, V)

    def forward(self, tokens):
        y, _ = self.rnn(self.emb(tokens))
        return self.out(y)


def train_losses(model, steps=3, seed=0):
    torch.manual_seed(seed)
    data = torch.randint(0, 11, (steps, 7, 3))                 # [steps, T+1, B]
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for tokens in data:
        logits = model(tokens[:-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_trains_like_torch_nn(backend):
    """torch.compile(fullgraph=True) of a model holding a numbarnn LSTM: no graph break (fullgraph raises on
    one), and three Adam steps give torch.nn's losses (float32)."""
    torch.manual_seed(1)
    ours = LanguageModel(LSTM)
    ref = LanguageModel(torch.nn.LSTM)
    ref.load_state_dict(ours.state_dict())
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    got, want = train_losses(compiled), train_losses(ref)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_compile_draws_fresh_dropout_masks_per_call():
    """The Philox keys are an operator input drawn by torch.randint in the graph, not constants baked into it:
    a compiled model's masks follow torch's seed as the eager model's do, and change from call to call."""
    torch.manual_seed(2)
    model = LanguageModel(LSTM, dropout=0.5).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 11, (5, 2))
    torch.manual_seed(7)
    eager = model(tokens)
    torch.manual_seed(7)
    first = compiled(tokens)
    second = compiled(tokens)
    torch.testing.assert_close(first, eager)
    assert not torch.equal(first, second)


def test_export_runs_like_the_module():
    torch.manual_seed(3)
    model = LanguageModel(LSTM).eval()
    tokens = torch.randint(0, 11, (5, 2))
    exported = torch.export.export(model, (tokens,))
    assert "torch.ops.numbarnn.rnn" in exported.graph_module.code
    torch.testing.assert_close(exported.module()(tokens), model(tokens))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_meta_device_gives_torch_nn_shapes(kind, batch_first):
    ours, ref = (m.to("meta") for m in pair(kind, num_layers=2, bidirectional=True, batch_first=batch_first))
    x = torch.empty(2, 5, 3, device="meta") if batch_first else torch.empty(5, 2, 3, device="meta")
    got, want = ours(x.to(F64)), ref(x.to(F64))
    flat = (lambda out: [out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],))])
    for a, b in zip(flat(got), flat(want)):
        assert a.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype


# ---------------------------------------------------------------------------------------------------
# torch.func
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lstm_proj", "gru"])
def test_torch_func_transforms_match_torch_nn(kind):
    """vmap over the batch of inputs and over stacked parameters, jacrev, jacfwd (forward mode: the network in
    torch operations), hessian, against torch.nn (vmap: against a loop, torch.nn's RNNs have no batching rule)."""
    ours, ref = pair(kind, num_layers=2, bidirectional=True)
    x = torch.randn(3, 2, 3, dtype=F64)
    xs = torch.randn(4, 3, 2, 3, dtype=F64)
    want = torch.stack([ref(v)[0] for v in xs])
    torch.testing.assert_close(torch.vmap(lambda v: ours(v)[0])(xs), want)
    torch.testing.assert_close(torch.vmap(lambda v: ours(v)[0], in_dims=2)(xs.movedim(0, 2)), want)
    params = {k: v.detach() + 0.01 * torch.randn(2, *v.shape, dtype=F64) for k, v in ours.named_parameters()}
    stacked = torch.vmap(lambda p: torch.func.functional_call(ours, p, (x,))[0])(params)
    loop = torch.stack([torch.func.functional_call(ref, {k: v[i] for k, v in params.items()}, (x,))[0]
                        for i in range(2)])
    torch.testing.assert_close(stacked, loop)
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(transform(lambda v: ours(v)[0])(x), transform(lambda v: ref(v)[0])(x))
    torch.testing.assert_close(torch.func.hessian(lambda v: ours(v)[0].pow(2).sum())(x),
                               torch.func.hessian(lambda v: ref(v)[0].pow(2).sum())(x))


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("kind", ["lstm_proj", "gru"])
def test_forward_mode_ad_with_dual_tensors_matches_torch_nn(kind, grad):
    """torch.autograd.forward_ad (dual tensors, not torch.func): tangents of the outputs as torch.nn's, with
    gradients on and off (under no_grad a tangent was silently dropped)."""
    from torch.autograd import forward_ad as fw

    ours, ref = pair(kind, num_layers=2, bidirectional=True)
    x, t = torch.randn(3, 2, 3, dtype=F64), torch.randn(3, 2, 3, dtype=F64)
    tangents = []
    for m in (ours, ref):
        with torch.set_grad_enabled(grad), fw.dual_level():
            y, state = m(fw.make_dual(x, t))
            outs = (y, *state) if isinstance(state, tuple) else (y, state)
            tangents.append([fw.unpack_dual(o).tangent for o in outs])
    assert all(v is not None and v.abs().max() > 0 for v in tangents[0])
    for a, b in zip(*tangents):
        torch.testing.assert_close(a, b)


def test_eager_calls_skip_the_dispatcher_and_tracing_keeps_the_operator(monkeypatch):
    """Plain eager calls run the operator's implementation directly (its dispatcher round trip costs as much as
    a small forward), with and without gradients; anything that traces (make_fx: a dispatch mode) still meets
    the registered operator, which the graph keeps as one node."""
    from numbarnn import torch_ops

    ours, ref = pair("lstm", num_layers=2)
    x = torch.randn(3, 2, 3, dtype=F64)
    called = []
    monkeypatch.setattr(torch.library.CustomOpDef, "__call__",
                        lambda self, *a, **k: called.append(self._name) or pytest.fail("dispatcher used"))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], ref(x)[0])
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(xg)[0].sum().backward()
    ref(xr)[0].sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    monkeypatch.undo()
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(lambda v: ours(v)[0])(x)
    assert any("numbarnn.rnn" in str(n.target) for n in graph.graph.nodes)
    torch.testing.assert_close(graph(x), ref(x)[0])
    assert torch_ops._eager((x,)) and not torch_ops._eager((x.to("meta"),))


def test_inference_mode_matches_torch_nn():
    """torch.inference_mode (inference tensors in and out) through the eager path, as torch.nn computes it."""
    ours, ref = pair("lstm_proj", num_layers=2, bidirectional=True)
    x = torch.randn(4, 2, 3, dtype=F64)
    with torch.inference_mode():
        got, want = ours(x), ref(x)
    assert got[0].is_inference()
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_gradcheck_with_batched_gradients():
    ours, _ = pair("lstm", num_layers=2)
    x = torch.randn(3, 2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: ours(v)[0], (x,), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(lambda v: ours(v)[0], (x,), check_batched_grad=True)


# ---------------------------------------------------------------------------------------------------
# bfloat16 and autocast
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_bfloat16_module(kind):
    """bf16 parameters and inputs: stored and returned as bf16, computed in float32 (the float32 module on the
    same bf16 values, rounded to bf16); gradients reach the bf16 parameters as bf16."""
    ours, _ = pair(kind, dtype=torch.float32, num_layers=2)
    wide = ours
    narrow = KINDS[kind][0](3, 4, num_layers=2, **KINDS[kind][2], dtype=torch.bfloat16)
    narrow.load_state_dict({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()})
    wide.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ours.state_dict().items()})
    x = torch.randn(5, 2, 3).to(torch.bfloat16)
    y = narrow(x)[0]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, wide(x.float())[0].to(torch.bfloat16), rtol=0, atol=0)
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in narrow.parameters())


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu"])
def test_autocast_outputs_in_the_autocast_dtype(kind):
    """Under torch.autocast("cpu") a float32 module computes as torch.nn's RNNs do there: input, state and
    weights cast to the autocast dtype (bfloat16), outputs in it; gradients reach the float32 parameters."""
    ours, _ = pair(kind, dtype=torch.float32)
    x = torch.randn(4, 2, 3)
    with torch.autocast("cpu"):
        out, final = ours(x)
    dtype = torch.get_autocast_dtype("cpu")
    assert out.dtype == dtype
    assert all(t.dtype == dtype for t in (final if isinstance(final, tuple) else (final,)))
    rounded = KINDS[kind][0](3, 4, **KINDS[kind][2])
    rounded.load_state_dict({k: v.to(dtype).float() for k, v in ours.state_dict().items()})
    torch.testing.assert_close(out, rounded(x.to(dtype).float())[0].to(dtype), rtol=0, atol=0)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ours.parameters())


def test_autocast_rnn():
    """PyTorch's test/test_autocast.py TestAutocastCPU.test_autocast_rnn (there only where oneDNN has bf16)."""
    x = torch.randn(1, 2, 1)
    hx = torch.randn(2, 2, 1)
    cx = torch.randn(2, 2, 1)
    m = LSTM(1, 1, 2).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"RNN input dtype .* does not match weight dtype"):
        m(x, (hx, cx))
    with torch.amp.autocast(device_type="cpu"):
        m(x, (hx, cx))


def test_numbarnn_torch_is_an_attribute_after_import_numbarnn():
    """`import numbarnn` does not import torch; `numbarnn.torch` then imports it on first use."""
    import subprocess
    import sys
    code = ("import sys, numbarnn; assert 'torch' not in sys.modules; "
            "from numbarnn.torch import LSTM; assert numbarnn.torch.LSTM is LSTM")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_thread_count_is_used_and_kept():
    """Inside numbarnn.torch the cpu backend's loops run on torch's thread count, and torch's setting survives
    the call (numba's OpenMP layer, started by the first call, used to reset it: libgomp is shared); numba's own
    setting is restored after each call.  In a fresh process: the layer starts at the first call."""
    import subprocess
    import sys
    code = """
import numba, torch
torch.set_num_threads(1)
import numbarnn.torch as nt
from numbarnn.cpu import backend
seen = []
for name in ("rnn_forward", "rnn_backward"):
    setattr(backend, name, lambda *a, real=getattr(backend, name): (seen.append(numba.get_num_threads()), real(*a))[1])
numba_threads = numba.get_num_threads()
m = nt.LSTM(16, 16, 2, backend="cpu")
x = torch.randn(8, 64, 16, requires_grad=True)
y, _ = m(x)
y.sum().backward()
assert torch.get_num_threads() == 1, torch.get_num_threads()
assert seen == [1, 1], seen
assert numba.get_num_threads() == numba_threads
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

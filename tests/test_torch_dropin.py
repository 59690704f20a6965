"""numbarnn.torch.LSTM / GRU / RNN: drop-ins for torch.nn.LSTM / GRU / RNN (skipped without torch).

Checked: torch.autograd.gradcheck (input, h0, c0 and every parameter; padded and packed ragged input; dropout
under a fixed torch seed); outputs and every gradient equal torch.nn's with the same state_dict (padded,
batch_first, PackedSequence with enforce_sorted=False, unbatched; also when only h_n is used); state_dict and
default init interchangeable both ways; dropout (eval: none; p=1: layer>0 inputs are zero; per-call masks from
torch's generator, reproducible with torch.manual_seed); bias=False; float32; clear errors for bad arguments.
numbarnn runs on backend="reference" (one tiny case on "cuda", i.e. the simulator), float64 unless stated.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.params import from_torch_state_dict, params_size  # noqa: E402
from numbarnn.torch import GRU, LSTM, RNN, RNNDtypeError, RNNShapeError  # noqa: E402

BACKEND = "reference"
F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)

# kind -> (numbarnn.torch class, torch.nn class, extra constructor arguments)
KINDS = {
    "lstm": (LSTM, torch.nn.LSTM, {}),
    "lstm_proj": (LSTM, torch.nn.LSTM, {"proj_size": 2}),
    "gru": (GRU, torch.nn.GRU, {}),
    "rnn_tanh": (RNN, torch.nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
}


def make_pair(kind, input_size=2, hidden_size=3, dtype=F64, seed=0, **kw):
    """(numbarnn module, torch.nn module) holding the same parameters (ours -> torch, strict)."""
    ours_cls, torch_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    ours = ours_cls(input_size, hidden_size, **extra, **kw, dtype=dtype, backend=BACKEND)
    ref = torch_cls(input_size, hidden_size, **extra, **kw, dtype=dtype)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def is_lstm(module) -> bool:
    return isinstance(module, (LSTM, torch.nn.LSTM))


def initial_state(module, B, dtype=F64, batched=True, seed=1):
    """Random (h0, c0 or None): [L*D, B, P] and [L*D, B, H] (no batch axis when unbatched)."""
    g = torch.Generator().manual_seed(seed)
    LD = module.num_layers * (2 if module.bidirectional else 1)
    P = module.proj_size or module.hidden_size
    shape = (LD, B) if batched else (LD,)
    h0 = (0.5 * torch.randn(*shape, P, generator=g, dtype=dtype)).requires_grad_()
    c0 = (0.5 * torch.randn(*shape, module.hidden_size, generator=g, dtype=dtype)).requires_grad_() \
        if is_lstm(module) else None
    return h0, c0


def hx_of(h0, c0):
    return h0 if c0 is None else (h0, c0)


def finals(final):
    return tuple(final) if isinstance(final, tuple) else (final,)


def run_and_grad(module, x, h0, c0, make_input, use_output=True, seed=7):
    """Forward, then backward of a random linear function of (output, h_n[, c_n]).

    -> (output tensor (PackedSequence data if packed), finals, {name: grad} for input, h0, c0, every parameter).
    """
    module.zero_grad()
    for t in (x, h0, c0):
        if t is not None:
            t.grad = None
    out, final = module(make_input(x), hx_of(h0, c0))
    y = out.data if isinstance(out, PackedSequence) else out
    g = torch.Generator().manual_seed(seed)
    loss = (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum() if use_output else 0.0
    for s in finals(final):
        loss = loss + (s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()
    loss.backward()
    grads = {"input": x.grad, "h0": h0.grad}
    if c0 is not None:
        grads["c0"] = c0.grad
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, finals(final), grads


def assert_close(a, b, name, **tol):
    assert a is not None and b is not None, name
    assert a.shape == b.shape, (name, a.shape, b.shape)
    np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), err_msg=name, **(tol or TOL))


def compare(ours, ref, x, h0, c0, make_input, use_output=True, **tol):
    out1, fin1, g1 = run_and_grad(ours, x, h0, c0, make_input, use_output)
    out2, fin2, g2 = run_and_grad(ref, x, h0, c0, make_input, use_output)
    assert type(out1) is type(out2)
    if isinstance(out1, PackedSequence):
        assert torch.equal(out1.batch_sizes, out2.batch_sizes)
        for idx in ("sorted_indices", "unsorted_indices"):
            a, b = getattr(out1, idx), getattr(out2, idx)
            assert (a is None and b is None) or torch.equal(a, b), idx
        out1, out2 = out1.data, out2.data
    assert_close(out1, out2, "output", **tol)
    assert len(fin1) == len(fin2)
    for k, (a, b) in enumerate(zip(fin1, fin2)):
        assert_close(a, b, f"final state {k}", **tol)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert g1[name] is not None, f"no gradient reached {name}"
        assert_close(g1[name], g2[name], f"grad {name}", **tol)


# ---------------------------------------------------------------------------------------------------
# inputs: padded, batch_first, packed ragged (enforce_sorted=False), unbatched
# ---------------------------------------------------------------------------------------------------
LENGTHS = [2, 4, 1, 4]   # unsorted, with a tie: sorted_indices matter


def make_case(layout, T=4, B=4, I=2, seed=3):
    """-> (leaf x, make_input(x) -> what the module is called with, batch_first, batched)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        return torch.randn(T, B, I, generator=g, dtype=F64).requires_grad_(), (lambda x: x), False, True
    if layout == "batch_first":
        return torch.randn(B, T, I, generator=g, dtype=F64).requires_grad_(), (lambda x: x), True, True
    if layout == "unbatched":
        return torch.randn(T, I, generator=g, dtype=F64).requires_grad_(), (lambda x: x), False, False
    assert layout == "packed"
    lengths = torch.tensor(LENGTHS[:B])
    x = torch.randn(int(lengths.max()), B, I, generator=g, dtype=F64).requires_grad_()
    return x, (lambda x: pack_padded_sequence(x, lengths, enforce_sorted=False)), False, True


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["padded", "batch_first", "packed", "unbatched"])
def test_matches_torch_nn(kind, layout):
    x, make_input, batch_first, batched = make_case(layout)
    ours, ref = make_pair(kind, num_layers=2, bidirectional=True, batch_first=batch_first)
    h0, c0 = initial_state(ours, 4, batched=batched)
    compare(ours, ref, x, h0, c0, make_input)


@pytest.mark.parametrize("kind", ["lstm_proj", "gru"])
def test_unused_outputs_and_default_state(kind):
    """Only h_n (and c_n) feed the loss (output's gradient is None -> zeros); hx=None means zeros."""
    x, make_input, _, _ = make_case("packed")
    ours, ref = make_pair(kind, num_layers=2)
    h0, c0 = initial_state(ours, 4)
    compare(ours, ref, x, h0, c0, make_input, use_output=False)
    for module in (ours, ref):
        module.zero_grad()
    (y1, f1), (y2, f2) = ours(make_input(x)), ref(make_input(x))
    assert_close(y1.data, y2.data, "output, hx=None")
    for a, b in zip(finals(f1), finals(f2)):
        assert_close(a, b, "final, hx=None")


def test_eval_mode_backward_matches_torch():
    """Gradients also flow in eval mode (then the op keeps its reserve with dropout 0)."""
    x, make_input, _, _ = make_case("padded")
    ours, ref = make_pair("lstm", num_layers=2, dropout=0.5)
    ours.eval(), ref.eval()
    h0, c0 = initial_state(ours, 4)
    compare(ours, ref, x, h0, c0, make_input)


def test_no_grad_call_matches():
    x, make_input, _, _ = make_case("padded")
    ours, ref = make_pair("gru", num_layers=2, bidirectional=True)
    with torch.no_grad():
        y1, h1 = ours(x)
        y2, h2 = ref(x)
    assert y1.grad_fn is None and not y1.requires_grad
    assert_close(y1, y2, "output")
    assert_close(h1, h2, "h_n")


# ---------------------------------------------------------------------------------------------------
# gradcheck (finite differences) with respect to input, h0, c0 and every parameter
# ---------------------------------------------------------------------------------------------------

def gradcheck_module(module, x, h0, c0, make_input, seed=None, fast_mode=False):
    """gradcheck of (input, h0[, c0], *parameters) -> (output data, h_n[, c_n]) through functional_call.

    fast_mode (torch's): compares u^T J v for random u, v per input instead of the full Jacobian (far fewer
    forward calls; used on the bigger 2-layer bidirectional networks).
    """
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    lstm = c0 is not None

    def f(x, h0, *rest):
        c0, ps = (rest[0], rest[1:]) if lstm else (None, rest)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:   # the same dropout mask on every evaluation
                torch.manual_seed(seed)
            out, final = torch.func.functional_call(module, dict(zip(names, ps)), (make_input(x), hx_of(h0, c0)))
        return (out.data if isinstance(out, PackedSequence) else out,) + finals(final)

    inputs = (x, h0) + ((c0,) if lstm else ()) + tuple(params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast_mode)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gradcheck_padded(kind):
    """Full Jacobian: 1 layer, batch_first padded input."""
    x, make_input, _, _ = make_case("batch_first", T=3, B=2)
    ours, _ = make_pair(kind, batch_first=True)
    h0, c0 = initial_state(ours, 2)
    gradcheck_module(ours, x, h0, c0, make_input)


@pytest.mark.parametrize("kind", ["gru", "rnn_relu"])
def test_gradcheck_packed_bidirectional(kind):
    """Full Jacobian: 1 bidirectional layer on packed ragged input (reversal within each length)."""
    x, make_input, _, _ = make_case("packed", B=3)
    ours, _ = make_pair(kind, hidden_size=2, bidirectional=True)
    h0, c0 = initial_state(ours, 3)
    gradcheck_module(ours, x, h0, c0, make_input)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gradcheck_packed_two_layers(kind):
    """fast_mode: 2 bidirectional layers on packed ragged input."""
    x, make_input, _, _ = make_case("packed", B=3)
    ours, _ = make_pair(kind, num_layers=2, bidirectional=True)
    h0, c0 = initial_state(ours, 3)
    gradcheck_module(ours, x, h0, c0, make_input, fast_mode=True)


def test_gradcheck_with_dropout():
    """Under a fixed torch seed the Philox mask is the same in every evaluation, and backward reuses it."""
    x, make_input, _, _ = make_case("packed", B=3)
    ours, _ = make_pair("lstm", num_layers=2, bidirectional=True, dropout=0.4)
    h0, c0 = initial_state(ours, 3)
    gradcheck_module(ours, x, h0, c0, make_input, seed=11, fast_mode=True)


@pytest.mark.parametrize("kind", list(KINDS))
def test_double_backward_matches_torch_nn(kind):
    """create_graph=True: the gradient is itself differentiable (numbarnn.torch_network recomputes the forward
    in torch operations from the cell's spec) and its gradient equals torch.nn's (a gradient penalty)."""
    ours, ref = make_pair(kind, num_layers=2, bidirectional=True)
    x, make_input, _, _ = make_case("padded", T=3, B=2)
    h0, c0 = initial_state(ours, 2)
    grads = []
    for module in (ours, ref):
        xs = x.detach().clone().requires_grad_()
        out, _ = module(xs, hx_of(h0, c0) if is_lstm(module) else h0)
        (g,) = torch.autograd.grad((out * out).sum(), xs, create_graph=True)
        penalty = (g ** 2).sum()
        grads.append(torch.autograd.grad(penalty, [xs, *module.parameters()]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm_proj", "gru", "rnn_relu"])
def test_gradgradcheck(kind):
    """torch.autograd.gradgradcheck through the drop-in: packed ragged input, two layers, bidirectional."""
    ours, _ = make_pair(kind, num_layers=2, bidirectional=True)
    lengths = torch.tensor([3, 1, 2])
    x = torch.randn(3, 3, ours.input_size, dtype=F64, requires_grad=True)
    h0, c0 = initial_state(ours, 3)
    h0.requires_grad_()

    def f(x, h0):
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, _ = ours(packed, hx_of(h0, c0) if is_lstm(ours) else h0)
        return pad_packed_sequence(out)[0]

    assert torch.autograd.gradgradcheck(f, (x, h0))


def test_double_backward_with_dropout_uses_the_same_masks():
    """With dropout, the recomputed forward draws the call's Philox masks: the first-order gradient it yields
    under create_graph equals the kernels' (create_graph=False) for the same call."""
    ours, _ = make_pair("lstm", num_layers=2, dropout=0.5)
    x = torch.randn(4, 2, ours.input_size, dtype=F64, requires_grad=True)
    torch.manual_seed(3)
    (plain,) = torch.autograd.grad(ours(x)[0].sum(), x)
    torch.manual_seed(3)
    (graph,) = torch.autograd.grad(ours(x)[0].sum(), x, create_graph=True)
    assert graph.requires_grad
    torch.testing.assert_close(graph, plain, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# parameters: names, shapes, init, state_dict both ways

# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bias", [True, False])
def test_parameters_and_init_like_torch(kind, bias):
    ours_cls, torch_cls, extra = KINDS[kind]
    torch.manual_seed(5)
    ours = ours_cls(3, 4, num_layers=2, bidirectional=True, bias=bias, **extra, backend=BACKEND)
    torch.manual_seed(5)
    ref = torch_cls(3, 4, num_layers=2, bidirectional=True, bias=bias, **extra)
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b)                      # same names, same order
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name   # same uniform(-1/sqrt(H), 1/sqrt(H)) draws
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    if not bias:
        assert not any("bias" in n for n in a)
    bound = 1 / np.sqrt(4)
    assert all(float(p.detach().abs().max()) <= bound for p in ours.parameters())


@pytest.mark.parametrize("kind", ["lstm_proj", "rnn_relu"])
def test_state_dict_round_trip_both_ways(kind):
    x, make_input, _, _ = make_case("packed")
    ours, _ = make_pair(kind, num_layers=2, bidirectional=True, seed=1)
    _, ref = make_pair(kind, num_layers=2, bidirectional=True, seed=2)   # different weights
    ours.load_state_dict(ref.state_dict(), strict=True)                 # torch.nn -> numbarnn
    h0, c0 = initial_state(ours, 4)
    compare(ours, ref, x, h0, c0, make_input)
    ref2 = KINDS[kind][1](2, 3, num_layers=2, bidirectional=True, **KINDS[kind][2], dtype=F64)
    ref2.load_state_dict(ours.state_dict(), strict=True)                # numbarnn -> torch.nn
    assert all(torch.equal(p, q) for p, q in zip(ref2.parameters(), ref.parameters()))
    # the opaque buffer the Function builds is numbarnn's from_torch_state_dict of the same state_dict
    from numbarnn.torch_tensors import _opaque_params
    layout = ours._layout
    np.testing.assert_array_equal(_opaque_params(layout.spans, ours._flat_weights, x,
                                                 params_size(layout.config)).numpy(),
                                  from_torch_state_dict(ours._config, ours.state_dict()))


@pytest.mark.parametrize("kind", ["lstm_proj", "gru", "rnn_tanh"])
def test_bias_false_matches_torch(kind):
    x, make_input, _, _ = make_case("packed")
    ours, ref = make_pair(kind, num_layers=2, bidirectional=True, bias=False)
    assert not any("bias" in n for n, _ in ours.named_parameters())
    h0, c0 = initial_state(ours, 4)
    compare(ours, ref, x, h0, c0, make_input)


# ---------------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------------

def test_dropout_eval_mode_has_none():
    x, _, _, _ = make_case("padded")
    ours, ref = make_pair("lstm", num_layers=3, dropout=0.7)
    ours.eval(), ref.eval()
    with torch.no_grad():
        (y1, _), (y2, _), (y3, _) = ours(x), ours(x), ref(x)
    assert torch.equal(y1, y2)
    assert_close(y1, y3, "output")


@pytest.mark.parametrize("kind", ["lstm_proj", "gru"])
def test_dropout_p1_zeroes_inputs_of_upper_layers(kind):
    """p = 1: layer 1 sees zeros, so it equals a 1-layer torch.nn module fed zeros; layer 0 is unaffected."""
    x, _, _, _ = make_case("padded")
    ours, _ = make_pair(kind, num_layers=2, bidirectional=True, dropout=1.0)
    h0, c0 = initial_state(ours, 4)
    y, final = ours(x, hx_of(h0, c0))                  # training mode (the default)
    sd = ours.state_dict()
    ours_cls, torch_cls, extra = KINDS[kind]
    D, P = 2, ours.proj_size or ours.hidden_size
    layer0 = torch_cls(2, 3, bidirectional=True, **extra, dtype=F64)
    layer0.load_state_dict({k: v for k, v in sd.items() if "_l0" in k})
    layer1 = torch_cls(D * P, 3, bidirectional=True, **extra, dtype=F64)
    layer1.load_state_dict({k.replace("_l1", "_l0"): v for k, v in sd.items() if "_l1" in k})
    states = [(h0[:2], None if c0 is None else c0[:2]), (h0[2:], None if c0 is None else c0[2:])]
    with torch.no_grad():
        _, f0 = layer0(x, hx_of(*states[0]))
        y1, f1 = layer1(torch.zeros(4, 4, D * P, dtype=F64), hx_of(*states[1]))
    assert_close(y, y1, "output (layer 1 fed zeros)")
    for ours_state, s0, s1 in zip(finals(final), finals(f0), finals(f1)):
        assert_close(ours_state, torch.cat([s0, s1]), "final states")
    y.sum().backward()                                  # gradients still flow (to layer 0 through h_n only)
    assert all(p.grad is not None for p in ours.parameters())


def test_dropout_masks_follow_torch_seed():
    x, _, _, _ = make_case("padded")
    ours, _ = make_pair("rnn_tanh", num_layers=3, dropout=0.5)
    torch.manual_seed(42)
    a1, a2 = ours(x)[0], ours(x)[0]
    torch.manual_seed(42)
    b1, b2 = ours(x)[0], ours(x)[0]
    assert torch.equal(a1, b1) and torch.equal(a2, b2)   # reproducible
    assert not torch.equal(a1, a2)                       # a fresh mask per call
    with torch.no_grad():                                # training mode without grad: still dropout
        torch.manual_seed(42)
        assert torch.equal(ours(x)[0], a1)
    ours.eval()
    assert not torch.equal(ours(x)[0], a1)


def test_dropout_seeds_are_two_randint_draws():
    """The documented contract: (seed, seed2) = torch.randint(0, 2**32, (2,)) from the default generator."""
    x, _, _, _ = make_case("padded")
    ours, _ = make_pair("gru", num_layers=2, dropout=0.5)
    torch.manual_seed(3)
    y, h = ours(x)
    torch.manual_seed(3)
    seed, seed2 = (int(v) for v in torch.randint(0, 2 ** 32, (2,), dtype=torch.int64))
    params = from_torch_state_dict(ours._config, ours.state_dict())
    h0 = np.zeros((2, 4, 3))
    y_op, h_op, *_ = ops.cudnn_rnn_v3(x.detach().numpy(), h0, None, params, rnn_mode="gru", dropout=0.5,
                                      seed=seed, seed2=seed2, is_training=True, backend=BACKEND)
    np.testing.assert_allclose(y.detach().numpy(), y_op, **TOL)
    np.testing.assert_allclose(h.detach().numpy(), h_op, **TOL)


# ---------------------------------------------------------------------------------------------------
# dtypes, backends
# ---------------------------------------------------------------------------------------------------

def test_float32_matches_torch():
    x, make_input, _, _ = make_case("packed")
    ours, ref = make_pair("lstm", num_layers=2, bidirectional=True, dtype=torch.float32)
    x = x.detach().float().requires_grad_()
    h0, c0 = initial_state(ours, 4, dtype=torch.float32)
    out, (hn, cn) = ours(make_input(x), (h0, c0))
    assert out.data.dtype == hn.dtype == cn.dtype == torch.float32
    compare(ours, ref, x, h0, c0, make_input, rtol=1e-4, atol=1e-5)


def test_cuda_backend_in_simulator_matches_reference():
    """backend="cuda" with CPU tensors: NumPy in, kernels (here numba's simulator), NumPy out."""
    x, make_input, _, _ = make_case("packed", T=2, B=2)
    ours, ref = make_pair("lstm", hidden_size=2)
    fast = LSTM(2, 2, dtype=F64, backend="cuda")
    fast.load_state_dict(ours.state_dict())
    h0, c0 = initial_state(ours, 2)
    out1, fin1, g1 = run_and_grad(fast, x, h0, c0, make_input)
    out2, fin2, g2 = run_and_grad(ours, x, h0, c0, make_input)
    assert_close(out1.data, out2.data, "output", rtol=1e-9, atol=1e-11)
    for name in g1:
        assert_close(g1[name], g2[name], name, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: GRU(2, 3, proj_size=1), "proj_size.*only supported for LSTM"),
    (lambda: RNN(2, 3, proj_size=1), "proj_size.*only supported for LSTM"),
    (lambda: LSTM(2, 3, proj_size=3), "proj_size has to be smaller than hidden_size .got proj_size=3, hidden"),
    (lambda: LSTM(2, 3, proj_size=-1), "proj_size"),
    (lambda: RNN(2, 3, nonlinearity="sigmoid"), "nonlinearity"),
    (lambda: LSTM(2, 3, dropout=1.5), "dropout"),
    (lambda: LSTM(0, 3), "input_size"),
    (lambda: GRU(2, 0), "hidden_size"),
    (lambda: LSTM(2, 3, num_layers=0), "num_layers"),
    (lambda: LSTM(2, 3, backend="tpu"), "backend"),
])
def test_bad_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_constructor_types():
    with pytest.raises(TypeError, match="hidden_size"):
        LSTM(2, 3.0)
    with pytest.raises(TypeError, match="bias"):
        GRU(2, 3, bias="yes")


def test_bad_call_arguments():
    """torch.nn's messages first (as torch.nn raises them), then numbarnn's detail."""
    lstm = LSTM(3, 4, num_layers=2, dtype=F64, backend=BACKEND)
    x = torch.zeros(5, 2, 3, dtype=F64)
    h, c = torch.zeros(2, 2, 4, dtype=F64), torch.zeros(2, 2, 4, dtype=F64)
    with pytest.raises(RNNShapeError, match=r"^input.size\(-1\) must be equal to input_size. Expected 3, got 7 "
                                            r"\(input: shape \(5, 2, 7\)\)") as info:
        lstm(torch.zeros(5, 2, 7, dtype=F64))
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="^LSTM: Expected input to be 2D or 3D, got 4D instead"):
        lstm(torch.zeros(1, 5, 2, 3, dtype=F64))
    with pytest.raises(RuntimeError, match=r"^Expected hidden\[0\] size \(2, 2, 4\), got \[2, 3, 4\] \(h_0: "):
        lstm(x, (torch.zeros(2, 3, 4, dtype=F64), c))
    with pytest.raises(RuntimeError, match=r"^Expected hidden\[1\] size \(2, 2, 4\), got \[1, 2, 4\]"):
        lstm(x, (h, torch.zeros(1, 2, 4, dtype=F64)))
    with pytest.raises(TypeError, match=r"hx: expected a tuple \(h_0, c_0\)"):
        lstm(x, h)
    with pytest.raises(RuntimeError, match=r"^For unbatched 2-D input, hx and cx should also be 2-D but got "
                                           r"\(3-D, 3-D\) tensors"):
        lstm(torch.zeros(5, 3, dtype=F64), (h, c))
    with pytest.raises(RNNDtypeError, match=r"^RNN input dtype \(torch.float32\) does not match weight dtype "
                                            r"\(torch.float64\)") as info:
        lstm(x.float())
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(TypeError, match=r"^RNN input dtype \(torch.int64\) does not match"):
        lstm(x.to(torch.int64))
    with pytest.raises(RuntimeError, match="^Expected sequence length to be larger than 0 in RNN"):
        lstm(torch.zeros(0, 2, 3, dtype=F64))
    gru = GRU(3, 4, dtype=F64, backend=BACKEND)
    with pytest.raises(RuntimeError, match=r"^input.size\(-1\) must be equal to input_size. Expected 3, got 5 "
                                           r"\(input.data: "):
        gru(pack_padded_sequence(torch.zeros(3, 2, 5, dtype=F64), torch.tensor([3, 2])))
    with pytest.raises(TypeError, match="hx: expected dtype torch.float64"):
        gru(x, torch.zeros(1, 2, 4))


def test_torch_positional_arguments_and_repr():
    """GRU/RNN take torch.nn's positional order (proj_size after bidirectional, only 0); repr as torch.nn's."""
    assert GRU(3, 5, 1, True, False, 0.0, False, 0, backend=BACKEND).hidden_size == 5
    assert RNN(3, 5, 1, "relu", True, False, 0.0, False, 0, backend=BACKEND).mode == "RNN_RELU"
    with pytest.raises(ValueError, match="^proj_size argument is only supported for LSTM, not RNN or GRU"):
        GRU(3, 5, 1, True, False, 0.0, False, 2)
    with pytest.raises(ValueError, match="^Unknown nonlinearity 'sigmoid'. Select from 'tanh' or 'relu'."):
        RNN(3, 4, nonlinearity="sigmoid")
    for ours, theirs in ((RNN(3, 4, nonlinearity="relu"), torch.nn.RNN(3, 4, nonlinearity="relu")),
                         (LSTM(3, 4, 2, proj_size=2, bidirectional=True), torch.nn.LSTM(3, 4, 2, proj_size=2,
                                                                                         bidirectional=True)),
                         (GRU(3, 4, batch_first=True, dropout=0.5, num_layers=2),
                          torch.nn.GRU(3, 4, batch_first=True, dropout=0.5, num_layers=2))):
        assert repr(ours) == repr(theirs)


def test_packed_output_round_trips_to_padded():
    """pad_packed_sequence of our output gives zeros past each length, like torch.nn."""
    x, make_input, _, _ = make_case("packed")
    ours, ref = make_pair("gru", bidirectional=True)
    y1, _ = pad_packed_sequence(ours(make_input(x))[0])
    y2, _ = pad_packed_sequence(ref(make_input(x))[0])
    assert_close(y1, y2, "padded output")
    for b, n in enumerate(LENGTHS):
        assert torch.all(y1[n:, b] == 0)


@pytest.mark.parametrize("cell, proj", [("peephole_lstm", 0), ("cifg_lstm", 2), ("readme", 0)])
def test_gradgradcheck_user_cells(cell, proj):
    """Double backward for cells registered through the public API (cell vectors; a projection; the README's
    own cell, run from its text): the spec's forward, rebound to torch, is the differentiable path, checked
    against finite differences of the kernels' first-order gradients (gradgradcheck) and against gradcheck."""
    import re
    from pathlib import Path

    import numbarnn.contrib.cifg_lstm  # noqa: F401  (registers the contrib cells)
    import numbarnn.contrib.peephole_lstm  # noqa: F401
    from numbarnn.torch import RNNBase
    if cell == "readme":
        readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
        index, block = next((i, b) for i, b in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))
                            if "CellSpec(" in b)
        namespace = {"__name__": "__main__"}           # as tests/test_readme.py runs it (under its name for the
        #                                                 text too): an equal spec again, in either order
        exec(compile(block.split("print(check_cell")[0], f"README block {index}", "exec"), namespace)
        cell = namespace["cifg"].name
    torch.manual_seed(4)
    module = RNNBase(cell, 2, 3, num_layers=2, bidirectional=True, proj_size=proj, dtype=F64, backend=BACKEND)
    x = torch.randn(3, 2, 2, dtype=F64, requires_grad=True)

    def f(x, *weights):
        out = torch.func.functional_call(module, dict(zip(module._flat_weights_names, weights)), (x,))
        return out[0], out[1][1]                          # y, c_n

    weights = [w.detach().requires_grad_() for w in module._flat_weights]
    assert torch.autograd.gradcheck(f, (x, *weights), fast_mode=True)
    assert torch.autograd.gradgradcheck(f, (x, *weights), fast_mode=True)


# ---------------------------------------------------------------------------------------------------
# the module's weight views (`_WeightViews`): the weights gathered through cached flat views of them
# ---------------------------------------------------------------------------------------------------

def _change_weights(module, how):
    """Change every weight of `module` (after a call filled its cache) in one of the ways users do."""
    if how == "optimizer":                                   # in place, version counter bumped
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    elif how == "data_inplace":                              # in place through .data: no version bump
        for p in module.parameters():
            p.data.mul_(-1.5).add_(0.25)
    elif how == "data_assign":                               # new memory under the same Parameter
        for p in module.parameters():
            p.data = p.data * 0.5 + 0.125
    elif how == "load_state_dict":
        module.load_state_dict({k: v * 2.0 - 0.5 for k, v in module.state_dict().items()})
    elif how == "new_parameter":                             # replaced Parameter objects
        for name in module._flat_weights_names:
            setattr(module, name, torch.nn.Parameter(getattr(module, name).detach() * -1.0 + 0.5))
    elif how == "non_contiguous":                            # the generic gather (no view of it is flat)
        for p in module.parameters():
            if p.dim() == 2:
                p.data = (p.data * 0.75).t().contiguous().t()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("how", ["optimizer", "data_inplace", "data_assign", "load_state_dict", "new_parameter",
                                 "non_contiguous"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_weights_changed_between_calls_are_seen(kind, how, mode):
    """A call after the weights changed (every way: optimizer steps, `.data` writes that bump no version counter,
    new memory, load_state_dict, new Parameters, non-contiguous weights) computes with the new weights: outputs
    and gradients equal torch.nn's holding the same weights."""
    ours, ref = make_pair(kind, num_layers=2, bias=kind == "lstm")
    x = torch.randn(3, 2, 2, dtype=F64)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():
        ours(x)                                              # fills the cache
    _change_weights(ours, how)
    ref.load_state_dict(ours.state_dict())
    with context():
        got, want = ours(x), ref(x)
    for a, b in zip((got[0], *finals(got[1])), (want[0], *finals(want[1]))):
        torch.testing.assert_close(a, b, **TOL)
    if mode == "grad":
        ours.zero_grad(), ref.zero_grad()
        (got[0].sum() + finals(got[1])[0].sum()).backward()
        (want[0].sum() + finals(want[1])[0].sum()).backward()
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


@pytest.mark.parametrize("kind", ["lstm", "gru", "lstm_proj"])
def test_weight_views_hit_equals_miss(kind):
    """Calls through the cached views (hits) give exactly what the generic gather gives (a miss) and what a fresh
    module gives, in every dtype; the cache holds views of the weights (no copy) and is rebuilt only when a
    weight's tensor or memory changes."""
    from numbarnn import torch_ops
    for dtype in (F64, torch.float32, torch.bfloat16):
        ours, _ = make_pair(kind, dtype=dtype, bias=kind != "gru")
        x = torch.randn(4, 3, 2, dtype=dtype)
        first = ours(x)
        entry = ours._weight_views._entry
        assert entry is not None
        pieces = [p for p in entry[1] if p.numel()]
        assert any(p.data_ptr() == w.data_ptr() for p in pieces for w in ours.parameters())
        second = ours(x)
        assert ours._weight_views._entry is entry                       # a hit
        with torch.no_grad():
            h0 = torch.zeros(ours.num_layers, 3, ours.proj_size or ours.hidden_size, dtype=dtype)
            c0 = torch.zeros(ours.num_layers, 3, ours.hidden_size, dtype=dtype) if kind != "gru" else None
            net = (ours.rnn_mode, ours.num_layers, ours.hidden_size, ours.input_size, False, ours.proj_size,
                   ours.bias, 0.0, False, BACKEND)
            miss = torch_ops._call(x, h0, c0, ours._flat_weights, None, torch_ops._NO_SEEDS, net)        # no views: gathered
        fresh, _ = make_pair(kind, dtype=dtype, bias=kind != "gru")
        for a, b, c, d in zip((first[0], *finals(first[1])), (second[0], *finals(second[1])),
                              (miss[0], miss[1], miss[2]), (fresh(x)[0], *finals(fresh(x)[1]))):
            assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def test_weight_views_across_inference_mode_and_copies():
    """Views made under inference_mode serve later training calls (backward works, gradients are torch.nn's);
    deepcopy and pickle give modules with their own weights (changing the original's leaves the copy's results)."""
    import copy
    import io
    ours, ref = make_pair("lstm", num_layers=2)
    x = torch.randn(3, 2, 2, dtype=F64)
    with torch.inference_mode():
        ours(x)
    y, (h, c) = ours(x)
    (y.sum() + c.sum()).backward()
    y_ref, (_, c_ref) = ref(x)
    (y_ref.sum() + c_ref.sum()).backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    twin = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    before = ours(x)[0].detach().clone()
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(0.5)
    assert not torch.equal(ours(x)[0], before)
    torch.testing.assert_close(twin(x)[0], before, **TOL)
    torch.testing.assert_close(loaded(x)[0], before, **TOL)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_backward_under_a_dispatch_mode_after_an_eager_forward(kind):
    """An eager forward (the operator's implementation called directly; no c_n tensor without a cell state) whose
    backward runs under a dispatch mode (there the registered backward operator): torch.nn's gradients."""
    from torch.utils.flop_counter import FlopCounterMode
    ours, ref = make_pair(kind, num_layers=2)
    x = torch.randn(3, 2, 2, dtype=F64, requires_grad=True)
    grads = []
    for module in (ours, ref):
        y, final = module(x)
        with FlopCounterMode(display=False):
            grads.append(torch.autograd.grad(y.sum() + finals(final)[0].sum(), (x, *module.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)


def test_module_pickled_without_the_per_call_helpers_runs():
    """A module pickled whole by a version without the cached weight views and cell-state flag (their state lacks
    them) unpickles into a working module."""
    import pickle

    from numbarnn.torch_cells import GRUCell
    for module, args in ((make_pair("lstm")[0], (torch.randn(3, 2, 2, dtype=F64),)),
                         (GRUCell(2, 3, dtype=F64, backend=BACKEND), (torch.randn(4, 2, dtype=F64),))):
        want = module(*args)
        old = type(module).__new__(type(module))
        old.__dict__.update(module.__dict__)
        for name in ("_weight_views", "_cell_state"):
            old.__dict__.pop(name, None)
        got = pickle.loads(pickle.dumps(old))(*args)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, **TOL)

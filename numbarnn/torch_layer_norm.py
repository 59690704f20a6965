"""haste's LayerNormLSTM and LayerNormGRU as numbarnn.torch modules: haste's argument and parameter names, numbarnn's
operator (the contrib cells layer_norm_lstm and layer_norm_gru, SPEC 13) on any backend.

    LayerNormLSTM(input_size, hidden_size, batch_first=False, forget_bias=1.0, dropout=0.0, zoneout=0.0,
                  return_state_sequence=False)  -> forward(input, state=None, lengths=None) -> (output, (h_n, c_n))
    LayerNormGRU(input_size, hidden_size, batch_first=False, dropout=0.0, zoneout=0.0,
                 return_state_sequence=False)   -> forward(input, state=None, lengths=None) -> (output, h_n)

Parameters as haste's (one layer, one direction; gates in its order): kernel [I, G*H], recurrent_kernel [H, G*H],
bias [G*H] (the GRU also recurrent_bias [G*H]), gamma [2, G*H] (W x's gain, then R h's), and the LSTM's gamma_h,
beta_h [H] (the cell state's gain and bias); haste's initialisation.  `dropout` is haste's DropConnect on
recurrent_kernel in training.  `zoneout` is haste's zoneout of h (SPEC 6.1; in [0, 1)): in training a Philox mask
drawn per call (fresh keys from torch's generator, as numbarnn.torch.LSTM's) keeps h_prev where it is 0, in eval
mode h' = p*h_prev + (1-p)*h_new (its gradient, when asked for, through numbarnn.torch_network).  States are
(1, B, H) as haste's; outputs past a row's length are 0 (haste leaves them unspecified).

return_state_sequence=True returns, as haste, the state after every step instead of the final one: h_n (and the
LSTM's c_n) are (1, T, B, H) ((1, B, T, H) with batch_first), the initial state not included.  A row past its
length keeps its state (SPEC 5), so its entries there repeat its final state (haste's run on over the padding).
Cost: LayerNormGRU's h sequence is the kernels' output y (the held state past a row's length), at the kernels'
speed; the LSTM's c sequence is no kernel output and the kernels' backward takes no dc per step, so LayerNormLSTM
with return_state_sequence=True runs the layer as torch operations (numbarnn.torch_network, a dozen small
operations a step, autograd's backward): correct gradients from every returned state, at about ten times the
kernels' time on the CPU (forward and backward, T=50, B=16, I=32, H=64, one torch thread: 114 ms against 12 ms).
Second derivatives (create_graph=True) come from numbarnn.torch_network as for numbarnn.torch's other modules.
"""
from __future__ import annotations

import torch

from . import torch_network
from .config import check_zoneout
from .torch_ops import _NO_SEEDS, _call, _seeds
from .torch_tensors import _call_config, _compute_dtype, _layout, _needs_reserve


class _HasteLayerNorm(torch.nn.Module):
    """What LayerNormLSTM and LayerNormGRU share: argument checks, the call of numbarnn's operator."""

    cell = ""
    gates = 0

    def __init__(self, input_size, hidden_size, batch_first=False, dropout=0.0, zoneout=0.0,
                 return_state_sequence=False, *, backend=None, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        for arg, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"{name}: dropout must be in [0.0, 1.0], got {dropout!r}")
        try:
            zoneout = check_zoneout(zoneout)                 # haste's zoneout of h (SPEC 6.1): [0, 1), 0 = none
        except ValueError as exc:                            # (a TypeError too for a non-number)
            raise type(exc)(f"{name}: {exc}") from None
        if not isinstance(return_state_sequence, bool):
            raise TypeError(f"{name}: return_state_sequence must be a bool, got {return_state_sequence!r}")
        import numbarnn.contrib.layer_norm_gru  # lazy: registers the cells when a layer is made  # noqa: F401
        import numbarnn.contrib.layer_norm_lstm  # lazy: registers the cells when a layer is made  # noqa: F401
        self.input_size, self.hidden_size, self.batch_first = input_size, hidden_size, bool(batch_first)
        self.dropout, self.zoneout, self.return_state_sequence = float(dropout), zoneout, return_state_sequence
        self.backend = backend
        G, H, factory = self.gates, hidden_size, {"device": device, "dtype": dtype}
        self.kernel = torch.nn.Parameter(torch.empty(input_size, G * H, **factory))             # [I, G*H]
        self.recurrent_kernel = torch.nn.Parameter(torch.empty(H, G * H, **factory))            # [H, G*H]
        self.bias = torch.nn.Parameter(torch.empty(G * H, **factory))                           # [G*H]
        self._extra_parameters(factory)
        self.gamma = torch.nn.Parameter(torch.empty(2, G * H, **factory))                       # [2, G*H]

    def _extra_parameters(self, factory) -> None:
        pass

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        for name, default in (("batch_first", False), ("forget_bias", 1.0), ("dropout", 0.0), ("zoneout", 0.0),
                              ("return_state_sequence", False), ("backend", None)):
            value = getattr(self, name, default)
            if value != default:
                s += f", {name}={value!r}"
        return s

    def reset_parameters(self) -> None:
        """haste's: per gate block Xavier-uniform kernel and orthogonal recurrent_kernel, zero biases, unit gains."""
        H = self.hidden_size
        with torch.no_grad():
            for g in range(self.gates):
                torch.nn.init.xavier_uniform_(self.kernel[:, g * H:(g + 1) * H])
                torch.nn.init.orthogonal_(self.recurrent_kernel[:, g * H:(g + 1) * H])
            torch.nn.init.zeros_(self.bias)
            torch.nn.init.ones_(self.gamma)

    def _weights(self, R) -> list:
        """The weights in numbarnn.torch's layout order (weight_ih, weight_hh, bias_ih, bias_hh, then the
        normalisation vectors)."""
        raise NotImplementedError

    def forward(self, input, state=None, lengths=None):
        if not isinstance(input, torch.Tensor) or input.dim() != 3:
            raise ValueError(f"{type(self).__name__}: input must be a 3-D tensor, got "
                             f"{getattr(input, 'shape', type(input).__name__)}")
        x = input.transpose(0, 1) if self.batch_first else input                           # [T, B, I]
        if x.size(-1) != self.input_size:
            raise ValueError(f"{type(self).__name__}: input.size(-1) must be input_size = {self.input_size}, got "
                             f"{x.size(-1)}")
        T, B = x.shape[0], x.shape[1]
        lstm = self.cell == "layer_norm_lstm"
        zeros = x.new_zeros((1, B, self.hidden_size))
        if state is None:
            h0, c0 = zeros, (zeros if lstm else None)                                       # [1, B, H]
        elif lstm:
            h0, c0 = state
        else:
            h0, c0 = state, None
        for what, t in (("h_0", h0), ("c_0", c0)):
            if t is not None and tuple(t.shape) != (1, B, self.hidden_size):
                raise ValueError(f"{type(self).__name__}: state {what} must be (1, batch, hidden_size) = "
                                 f"{(1, B, self.hidden_size)}, got {tuple(t.shape)}")
        lens = None
        if lengths is not None:
            lens = [int(v) for v in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
            if len(lens) != B or min(lens) < 0 or max(lens) > T:
                raise ValueError(f"{type(self).__name__}: lengths must be {B} values in [0, {T}], got {lens}")
        R = self.recurrent_kernel
        if self.training and self.dropout:                                                  # haste's DropConnect
            R = torch.nn.functional.dropout(R, self.dropout, True)
        weights = self._weights(R)
        zoneout_active = self.training and self.zoneout > 0
        if zoneout_active:                                   # fresh Philox keys per call (SPEC 6.1)
            seeds = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64)
        else:
            seeds = torch.zeros(2, dtype=torch.int64) if torch.compiler.is_compiling() else _NO_SEEDS
        if self.return_state_sequence and lstm:
            y, hT, cT = self._state_sequence_network(x, h0, c0, weights, lens, seeds)
        else:
            needs_grad = _needs_reserve(x, h0, c0, weights)
            # eval-mode zoneout is the op's inference (its gradient: torch_network's); else keep the reserve
            # whenever a gradient may be needed or masks are drawn
            is_training = bool(needs_grad or zoneout_active) and not (self.zoneout and not self.training)
            backend = self.backend or ("cuda" if x.is_cuda else "")
            net = (self.cell, 1, self.hidden_size, self.input_size, False, 0, True, 0.0, is_training, backend,
                   self.zoneout)                                     # (no dropout between layers: one layer)
            y, hT, cT, _ = _call(x, h0, c0, weights, lens, seeds, net, None, needs_grad)
            if self.return_state_sequence:                          # h after every step: y, held past a length
                hT = y if lens is None else torch.where(self._valid(lens, T, x.device)[:, :, None], y, hT)
        if self.return_state_sequence:                              # [T, B, H] -> haste's (1, T, B, H)
            hT, cT = (None if s is None else (s.transpose(0, 1) if self.batch_first else s).unsqueeze(0)
                      for s in (hT, cT))
        output = y.transpose(0, 1) if self.batch_first else y
        return (output, (hT, cT)) if lstm else (output, hT)

    @staticmethod
    def _valid(lens, T, device):
        """[T, B] bool: step t of row b runs (t < len[b])."""
        return torch.arange(T, device=device)[:, None] < torch.as_tensor(lens, device=device)[None, :]

    @torch.compiler.disable
    def _state_sequence_network(self, x, h0, c0, weights, lens, seeds):
        """The layer as torch operations (numbarnn.torch_network), with the states after every step:
        x [T, B, I], h0, c0 [1, B, H] -> (y [T, B, H], hs [T, B, H], cs [T, B, H]); zoneout's masks from `seeds`
        in training (the op's own Philox draws), its expectation in eval mode.  (Run eagerly under torch.compile:
        the masks and lengths are NumPy arrays, which dynamo does not trace.)"""
        layout = _layout(self.cell, 1, self.hidden_size, self.input_size, False, 0, True)
        cfg = _call_config(layout, 0.0, _seeds(seeds), self.zoneout)
        zoneout_keys = (cfg.seed, cfg.seed2) if self.training and self.zoneout else None
        dtype = _compute_dtype(x)
        layers = torch_network.layer_tensors(cfg, layout.slots, weights, dtype)
        y, _, _, hs, cs = torch_network.forward(cfg, layers, x.to(dtype), h0.to(dtype), c0.to(dtype), lens, None,
                                                zoneout_keys, state_sequence=True)
        return y.to(x.dtype), hs[0].to(x.dtype), cs[0].to(x.dtype)


class LayerNormLSTM(_HasteLayerNorm):
    """haste's LayerNormLSTM (gates i, g, f, o): see the module docstring."""

    cell = "layer_norm_lstm"
    gates = 4

    def __init__(self, input_size, hidden_size, batch_first=False, forget_bias=1.0, dropout=0.0, zoneout=0.0,
                 return_state_sequence=False, *, backend=None, device=None, dtype=None):
        self.forget_bias = float(forget_bias)
        super().__init__(input_size, hidden_size, batch_first, dropout, zoneout, return_state_sequence,
                         backend=backend, device=device, dtype=dtype)
        self.reset_parameters()

    def _extra_parameters(self, factory) -> None:
        self.gamma_h = torch.nn.Parameter(torch.empty(self.hidden_size, **factory))            # [H]
        self.beta_h = torch.nn.Parameter(torch.empty(self.hidden_size, **factory))             # [H]

    def reset_parameters(self) -> None:
        """haste's: as the base, the forget gate's bias `forget_bias`, gamma_h ones, beta_h zeros."""
        super().reset_parameters()
        H = self.hidden_size
        with torch.no_grad():
            self.bias[2 * H:3 * H] = self.forget_bias
            torch.nn.init.ones_(self.gamma_h)
            torch.nn.init.zeros_(self.beta_h)

    def _weights(self, R) -> list:
        return [self.kernel.t(), R.t(), self.bias, torch.zeros_like(self.bias), self.gamma[0], self.gamma[1],
                self.gamma_h, self.beta_h]


class LayerNormGRU(_HasteLayerNorm):
    """haste's LayerNormGRU (gates z, r, g): see the module docstring."""

    cell = "layer_norm_gru"
    gates = 3

    def __init__(self, input_size, hidden_size, batch_first=False, dropout=0.0, zoneout=0.0,
                 return_state_sequence=False, *, backend=None, device=None, dtype=None):
        super().__init__(input_size, hidden_size, batch_first, dropout, zoneout, return_state_sequence,
                         backend=backend, device=device, dtype=dtype)
        self.reset_parameters()

    def _extra_parameters(self, factory) -> None:
        self.recurrent_bias = torch.nn.Parameter(torch.empty(self.gates * self.hidden_size, **factory))   # [G*H]

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            torch.nn.init.zeros_(self.recurrent_bias)

    def _weights(self, R) -> list:
        return [self.kernel.t(), R.t(), self.bias, self.recurrent_bias, self.gamma[0], self.gamma[1]]

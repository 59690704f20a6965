"""Tutorial 04: a whole network with ragged sequence lengths, on both backends.

    python tutorials/04_network_ragged_lengths.py            # full run
    python tutorials/04_network_ragged_lengths.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
Real batches hold sequences of different lengths, padded to a common T.  cuDNN (and numbarnn,
SPEC section 5) take the true lengths and guarantee:

  * outputs at t >= len[b] are exactly 0, whatever the padding holds;
  * output_h / output_c are the state after each sequence's LAST VALID step (not after step T-1);
  * the reverse direction of a bidirectional layer runs t = len[b]-1 .. 0: the sequence is reversed
    WITHIN its length (padding stays at the end), not np.flip over all T;
  * a sequence of length 0 outputs zeros and keeps its initial state (numbarnn's choice, SPEC 5);
  * backprop ignores output_backprop at padded positions and returns input_backprop 0 there.

This script runs ops.cudnn_rnn_v3 / cudnn_rnn_backprop_v3 for a two-layer bidirectional LSTM on the
NumPy reference and on the numba.cuda kernels, asserts each of the points above, checks batch-major
layout (time_major=False: a real transpose, SPEC 3), shows haste's zoneout (`zoneout=p`, SPEC 6.1: each
step's h keeps its previous value where a Philox mask is 0; the expectation at inference), and times the two
backends.
Letters: T time, B batch, I input size, H units, P = H, L layers, D = 2 directions.
"""
from __future__ import annotations

import argparse
import os
import sys

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.reserve import reserve_contents  # noqa: E402
from numbarnn.testing import TOLERANCES, relative_error  # noqa: E402

from numbarnn.measure import timed_ms  # noqa: E402

SIM = bool(numba_config.ENABLE_CUDASIM)
ATTRS = dict(rnn_mode="lstm", direction="bidirectional")


def device_name() -> str:
    if SIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


class Batch:
    """A padded batch: x [T, B, I], lengths [B], states [L*D, B, H], params, upstream gradients."""

    def __init__(self, T, B, I, H, L, lengths, rng, dtype=np.float64):
        self.T, self.B, self.I, self.H, self.L, self.D = T, B, I, H, L, 2
        self.lens = np.asarray(lengths, np.int32)                                 # [B]
        self.valid = np.arange(T)[:, None] < self.lens[None, :]                   # [T, B]
        rand = lambda *shape: (rng.standard_normal(shape) * 0.5).astype(dtype)   # noqa: E731
        self.x = rand(T, B, I)                                                    # [T, B, I]
        self.x[~self.valid] = 0.0                                                 # tidy padding (any value works)
        self.h0, self.c0 = rand(L * 2, B, H), rand(L * 2, B, H)                   # [L*D, B, H]
        self.params = rand(ops.cudnn_rnn_params_size(L, H, I, **ATTRS))
        self.dy = rand(T, B, 2 * H)                                               # [T, B, D*H]
        self.dhT, self.dcT = rand(L * 2, B, H), rand(L * 2, B, H)

    def forward(self, backend, x=None, time_major=True):
        x = self.x if x is None else x
        if time_major:
            return ops.cudnn_rnn_v3(x, self.h0, self.c0, self.params, self.lens, backend=backend, **ATTRS)
        swap = lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1))               # noqa: E731
        return ops.cudnn_rnn_v3(swap(x), swap(self.h0), swap(self.c0), self.params, self.lens,
                                time_major=False, backend=backend, **ATTRS)

    def backward(self, backend, fwd, x=None, dy=None):
        y, hT, cT, reserve, host_reserved = fwd
        return ops.cudnn_rnn_backprop_v3(self.x if x is None else x, self.h0, self.c0, self.params, self.lens,
                                         y, hT, cT, self.dy if dy is None else dy, self.dhT, self.dcT, reserve,
                                         host_reserved, backend=backend, **ATTRS)


# ---------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------

def check_padding_and_states(bt: Batch, fwd, backend):
    y, hT, cT = fwd[:3]
    H, top = bt.H, (bt.L - 1) * bt.D                       # pseudo-layers of the last layer: top, top + 1
    assert not y[~bt.valid].any(), f"{backend}: nonzero output past a sequence's length"
    for b, n in enumerate(bt.lens):
        if n == 0:                                          # never active: initial state comes back
            assert np.array_equal(hT[:, b], bt.h0[:, b]) and np.array_equal(cT[:, b], bt.c0[:, b])
            continue
        # forward direction: its last step is t = len-1; reverse direction: its last step is t = 0
        assert np.array_equal(hT[top, b], y[n - 1, b, :H]), f"{backend}: forward output_h of row {b}"
        assert np.array_equal(hT[top + 1, b], y[0, b, H:]), f"{backend}: reverse output_h of row {b}"
    print(f"    {backend}: outputs past the lengths are 0; output_h = forward output at t = len-1 and reverse "
          f"output at t = 0; the len-0 row returns its initial state")


def check_backends_agree(ref, out, names, what, tol):
    for name, a, r in zip(names, out, ref):
        err = relative_error(a, r)
        assert err < tol, f"{what} {name}: cuda vs reference relative error {err:.1e} > {tol:.0e}"
    worst = max(relative_error(a, r) for a, r in zip(out, ref))
    print(f"    {what}: cuda == reference for {', '.join(names)} (worst relative error {worst:.0e}, "
          f"tolerance {tol:.0e})")


def reverse_within_lengths(x, lens):
    """x [T, B, K] -> x_rev with x_rev[t, b] = x[len[b]-1-t, b] for t < len[b], 0 after (padding stays last)."""
    out = np.zeros_like(x)
    for b, n in enumerate(lens):
        out[:n, b] = x[:n, b][::-1]
    return out


def check_reversal(bt: Batch):
    """The reverse direction of a one-layer bidirectional LSTM == a unidirectional LSTM with the reverse
    direction's weights on the input reversed within each length, its output reversed back the same way."""
    H, I = bt.H, bt.I
    params = np.random.default_rng(5).standard_normal(ops.cudnn_rnn_params_size(1, H, I, **ATTRS)) * 0.5
    y = ops.cudnn_rnn_v3(bt.x, bt.h0[:2], bt.c0[:2], params, bt.lens, backend="reference", **ATTRS)[0]
    weights, biases = ops.cudnn_rnn_params_to_canonical(1, H, I, params, **ATTRS)
    G = 4                                                   # canonical lists: [W_0..3, R_0..3] per direction
    rev_params = ops.cudnn_rnn_canonical_to_params(1, H, I, weights[2 * G:], biases[2 * G:], rnn_mode="lstm")
    x_rev = reverse_within_lengths(bt.x, bt.lens)
    y_uni = ops.cudnn_rnn_v3(x_rev, bt.h0[1:2], bt.c0[1:2], rev_params, bt.lens, rnn_mode="lstm",
                             backend="reference")[0]
    err = relative_error(y[:, :, H:], reverse_within_lengths(y_uni, bt.lens))
    assert err < 1e-14, f"reversal within lengths: relative error {err:.1e}"
    # np.flip over the whole T puts the padding first: a different (wrong) answer for short rows
    y_flip = ops.cudnn_rnn_v3(bt.x[::-1].copy(), bt.h0[1:2], bt.c0[1:2], rev_params, None, rnn_mode="lstm",
                              backend="reference")[0][::-1]
    short = bt.lens < bt.T
    assert np.abs(y_flip[:, short] * bt.valid[:, short, None] - y[:, short, H:]).max() > 1e-6
    print("    reverse direction == unidirectional LSTM (reverse weights, from the canonical lists) on x reversed "
          "within each length; a full np.flip over T gives other values for the short rows")


def check_padding_is_ignored(bt: Batch, backend, fwd, grads, rng):
    """Garbage in x and dy at padded positions changes nothing; input_backprop is 0 there."""
    x2, dy2 = bt.x.copy(), bt.dy.copy()
    x2[~bt.valid] = rng.standard_normal(x2[~bt.valid].shape) * 100.0
    dy2[~bt.valid] = rng.standard_normal(dy2[~bt.valid].shape) * 100.0
    fwd2 = bt.forward(backend, x=x2)
    grads2 = bt.backward(backend, fwd2, x=x2, dy=dy2)
    for name, a, b in zip(("output", "output_h", "output_c"), fwd[:3], fwd2[:3]):
        assert np.array_equal(a, b), f"{backend}: {name} depends on the padding"
    for name, a, b in zip(("input_h_backprop", "input_c_backprop", "params_backprop"), grads[1:], grads2[1:]):
        assert relative_error(b, a) < 1e-13, f"{backend}: {name} depends on the padding"
    assert not grads2[0][~bt.valid].any(), f"{backend}: nonzero input_backprop at a padded position"
    assert np.array_equal(grads2[0][bt.valid], grads[0][bt.valid])
    print(f"    {backend}: garbage (x100) in x and output_backprop past the lengths changes no output and no "
          f"gradient; input_backprop is 0 there")


def check_batch_major(bt: Batch, backend, fwd_tm):
    y, hT, cT = bt.forward(backend, time_major=False)[:3]
    assert y.shape == (bt.B, bt.T, 2 * bt.H) and hT.shape == (bt.B, 2 * bt.L, bt.H)
    for name, a, ref in (("output", y, fwd_tm[0]), ("output_h", hT, fwd_tm[1]), ("output_c", cT, fwd_tm[2])):
        assert relative_error(a, np.swapaxes(ref, 0, 1)) < 1e-14, f"{backend} batch-major {name}"
    print(f"    {backend}: time_major=False gives output [B, T, D*P] = {y.shape}, output_h [B, L*D, P] = "
          f"{hT.shape}: the time-major results transposed")


def check_zoneout(bt: Batch):
    """haste's zoneout (SPEC 6.1), an op argument beside dropout: in training h' = h_new where the mask is 1,
    else h_prev (only h, never c; y is the zoned-out h'); at inference h' = p*h_prev + (1-p)*h_new.  The mask is
    a pure function of (seed, seed2, pseudo-layer, t, b, j) on its own Philox stream, recorded in the reserve."""
    from numbarnn.reference.philox import zoneout_update_mask
    p, H, T = 0.5, bt.H, bt.T
    one = dict(rnn_mode="lstm", seed=7)                     # one layer, one direction: y is that layer's h'
    params = np.random.default_rng(6).standard_normal(ops.cudnn_rnn_params_size(1, H, bt.I)) * 0.5
    x, h0, c0 = bt.x[:, :1], bt.h0[:1, :1], bt.c0[:1, :1]   # row 0 (length T), [T, 1, I], [1, 1, H]
    y = ops.cudnn_rnn_v3(x, h0, c0, params, zoneout=p, backend="reference", **one)[0]          # [T, 1, H]
    update = zoneout_update_mask(7, 0, 0, T, 1, H, p)                                            # [T, 1, H]
    h_prev = np.concatenate([h0, y[:-1]])                                                        # [T, 1, H]
    assert np.array_equal(y[~update], h_prev[~update]), "zoneout: a masked unit must keep h_prev"
    assert (y[update] != h_prev[update]).all()
    y_eval = ops.cudnn_rnn_v3(x[:1], h0, c0, params, zoneout=p, is_training=False, backend="reference", **one)[0]
    y_new = ops.cudnn_rnn_v3(x[:1], h0, c0, params, is_training=False, backend="reference", **one)[0]
    assert np.allclose(y_eval, p * h0 + (1 - p) * y_new, rtol=0, atol=1e-15)
    print(f"    training: {int((~update).sum())} of {update.size} units kept h_prev (the Philox mask, p={p}); "
          f"inference: y = p*h0 + (1-p)*h_new")
    zo = dict(ATTRS, zoneout=p, seed=7)                     # the whole ragged network on both backends
    out = {}
    for backend in ("reference", "cuda"):
        fwd = ops.cudnn_rnn_v3(bt.x, bt.h0, bt.c0, bt.params, bt.lens, backend=backend, **zo)
        grads = ops.cudnn_rnn_backprop_v3(bt.x, bt.h0, bt.c0, bt.params, bt.lens, *fwd[:3], bt.dy, bt.dhT,
                                          bt.dcT, *fwd[3:], backend=backend, **zo)
        out[backend] = [*fwd[:3], *grads]
    check_backends_agree(out["reference"], out["cuda"], ("output", "output_h", "output_c", "input_backprop",
                                                         "input_h_backprop", "input_c_backprop",
                                                         "params_backprop"),
                         "zoneout=0.5, training", TOLERANCES[np.dtype(np.float64)][1])


# ---------------------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------------------

def benchmark(quick: bool, rng):
    if SIM:
        T, B, I, H, L = (4, 3, 2, 3, 2) if quick else (4, 4, 3, 4, 2)
        reps = 1
    else:
        T, B, I, H, L = (50, 32, 128, 128, 2) if quick else (100, 64, 256, 256, 2)
        reps = 2 if quick else 5
    lens = np.linspace(T, max(T // 3, 1), B).astype(np.int32)
    bt = Batch(T, B, I, H, L, lens, rng, np.float32)
    print(f"  {L}-layer bidirectional LSTM, T={T} B={B} I={I} H={H}, float32, lengths {lens.min()}..{lens.max()}, "
          f"NumPy arrays in and out, median of {reps}")
    for backend in ("reference", "cuda"):
        where = "NumPy, float64 inside" if backend == "reference" else device_name()
        out = {}
        t_fwd = timed_ms(lambda: out.update(fwd=bt.forward(backend)), reps)
        t_bwd = timed_ms(lambda: bt.backward(backend, out["fwd"]), reps)
        print(f"    backend={backend:<9} forward {t_fwd:9.2f} ms  backward {t_bwd:9.2f} ms   [{where}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    rng = np.random.default_rng(4)
    print(f"running on: {device_name()}")
    bt = Batch(T=4, B=3, I=2, H=3, L=2, lengths=[4, 1, 0], rng=rng)
    print(f"2-layer bidirectional LSTM, T={bt.T} B={bt.B} I={bt.I} H={bt.H}, lengths {bt.lens.tolist()}, float64")
    fwd = {b: bt.forward(b) for b in ("reference", "cuda")}
    grads = {b: bt.backward(b, fwd[b]) for b in ("reference", "cuda")}
    tol_out, tol_grad = TOLERANCES[np.dtype(np.float64)]
    print("1. both backends compute the same network")
    # reserve_contents: the reserve without its last 4 elements, the forward call's random nonce (numbarnn.reserve)
    check_backends_agree([*fwd["reference"][:3], reserve_contents(fwd["reference"][3])],
                         [*fwd["cuda"][:3], reserve_contents(fwd["cuda"][3])],
                         ("output", "output_h", "output_c", "reserve_space"), "forward", tol_out)
    check_backends_agree(grads["reference"], grads["cuda"], ("input_backprop", "input_h_backprop",
                                                             "input_c_backprop", "params_backprop"),
                         "backward", tol_grad)
    print("2. padding, final states and length-0 rows")
    for backend in ("reference", "cuda"):
        check_padding_and_states(bt, fwd[backend], backend)
    print("3. reversal within lengths")
    check_reversal(bt)
    print("4. the padding is never read")
    check_padding_is_ignored(bt, "reference", fwd["reference"], grads["reference"], rng)
    if not quick:
        check_padding_is_ignored(bt, "cuda", fwd["cuda"], grads["cuda"], rng)
    print("5. batch-major layout")
    check_batch_major(bt, "reference", fwd["reference"])
    check_batch_major(bt, "cuda", fwd["cuda"])
    print("6. zoneout (haste's), an option beside dropout")
    check_zoneout(bt)
    print("7. benchmark")
    benchmark(quick, rng)
    print("tutorial 04: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

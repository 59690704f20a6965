"""Tutorial 02: from the NumPy LSTM cell to the fused numba.cuda step kernel.

    python tutorials/02_fused_cell_kernel.py            # full run
    python tutorials/02_fused_cell_kernel.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
An RNN layer has two kinds of work (see `numbarnn/reference/network.py`):

    gx = x @ W^T                   for ALL T steps at once: one big GEMM, parallel over time
    for each step s (sequential):  gh = h @ R^T + bR           the recurrent matvec   [B, G*H]
                                   h, c = cell(gx[t] + bW + gh, c)   pointwise

The loop over time cannot be parallelised: step s needs the h of step s-1.  So the time loop is a
chain of T dependent launches, and for the small batches RNNs are trained with, each step is tiny
(B x P x 4H multiply-adds): the cost is the launch latency (a few microseconds each), not the math.
The straightforward GPU port spends D+1 launches per step (a GEMM per direction for gh, then a
pointwise cell kernel) and sends gh through global memory between them.

numbarnn fuses the recurrent matvec into the cell: one thread per (direction d, batch row b, unit j)
computes the four dot products R[g*H+j, :] . h[d, b, :] it needs (gate rows i, f, g, o of unit j),
keeps them in registers and applies the cell right away.  One launch per step serves both
directions (grid z = d); the reverse direction reads t = len[b]-1-s, so ragged lengths need no
reversed copy of the data.  Rows past their length copy their state through (h is double-buffered:
every thread reads all of h[d, b, :], so a step must not overwrite it in place).

This script shows that kernel, launches it for one step and compares it with the NumPy cell, runs
the whole time loop by hand against the reference op, counts launches per step in numbarnn's driver,
and times fused vs unfused vs NumPy.  Letters: T time, B batch, I input, H units, P = H (no
projection here), D directions.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import functools  # noqa: E402

import numpy as np  # noqa: E402
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.kernels import backend as cuda_backend  # noqa: E402
from numbarnn.cells import get_cell  # noqa: E402
from numbarnn.kernels import cell_steps  # noqa: E402

LSTM = get_cell("lstm")                 # the cell as data: gates, saved values, pointwise forward/backward
from numbarnn.kernels.common import acc_dtype, activations, blocks, jit, threads  # noqa: E402
from numbarnn.kernels.gemm import gemm  # noqa: E402
from numbarnn.params import unpack  # noqa: E402
from numbarnn.reference import lstm as ref_lstm  # noqa: E402
from numbarnn.measure import timed_ms  # noqa: E402
from numbarnn.testing import relative_error  # noqa: E402
from numbarnn.verify import TOLERANCES  # noqa: E402

SIM = bool(numba_config.ENABLE_CUDASIM)


def device_name() -> str:
    if SIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


# ---------------------------------------------------------------------------------------------------
# 1. The kernel
# ---------------------------------------------------------------------------------------------------

def show_kernel():
    """Print the step kernel as numbarnn ships it: the template's body, the LSTM's pointwise math, the wrapper."""
    src = inspect.getsource(cell_steps.make_forward_step)
    body = src[src.index("    def forward_body("):src.index("    name = f\"{cell.name}_forward_step\"")]
    print("  numbarnn/kernels/cell_steps.py, make_forward_step(cell, dtype, has_proj): the template body (closing"
          " over the cell's G, S, V and its pointwise function):")
    for line in body.rstrip().splitlines():
        print("  |" + line[4:])
    print("  numbarnn/cells/lstm.py: the pointwise forward it compiles in (plain Python, one unit):")
    for line in inspect.getsource(LSTM.forward).rstrip().splitlines():
        print("  |" + line)
    print("  and the LSTM's kernel: the cell's exact argument list, calling the body:")
    for line in cell_steps.make_forward_step(LSTM, "float64", False).source.rstrip().splitlines():
        print("  |" + line)


# ---------------------------------------------------------------------------------------------------
# 2. Problem set-up: a bidirectional one-layer LSTM with ragged lengths
# ---------------------------------------------------------------------------------------------------

class Problem:
    """Host arrays of one layer, in the layouts the step kernel takes (float64 here)."""

    def __init__(self, T, B, I, H, lens, rng, dtype=np.float64):
        self.cfg = rnn_config(1, H, I, "lstm", direction="bidirectional")
        self.T, self.B, self.I, self.H, self.D = T, B, I, H, 2
        self.dtype = np.dtype(dtype)
        self.lens = np.asarray(lens, np.int32)                                  # [B]
        self.params = (rng.standard_normal(ops.cudnn_rnn_params_size(1, H, I, direction="bidirectional"))
                       * 0.5).astype(dtype)                                     # opaque buffer (SPEC 4.2)
        layers = unpack(self.cfg, self.params)                                  # views: W, R, bW, bR per d
        self.W = [lp.W for lp in layers]                                        # D x [4H, I]
        self.R = [np.ascontiguousarray(lp.R) for lp in layers]                  # D x [4H, H]
        self.bias = np.stack([np.stack([lp.bW, lp.bR]) for lp in layers])       # [D, 2, 4H]
        self.unit_params = self.bias.reshape(self.D, 2 * 4, H)                  # [D, 2G, H]: bW, bR per gate
        self.x = rng.standard_normal((T, B, I)).astype(dtype)                   # [T, B, I]
        self.h0 = (rng.standard_normal((self.D, B, H)) * 0.5).astype(dtype)     # [D, B, H]
        self.c0 = (rng.standard_normal((self.D, B, H)) * 0.5).astype(dtype)     # [D, B, H]
        # the big GEMM outside the time loop (done by gemm v3 in numbarnn; NumPy here)
        self.gx = np.stack([self.x @ W.T for W in self.W]).astype(dtype)         # [D, T, B, 4H], no bias

    def device_buffers(self):
        """Fresh device buffers for a forward pass over the layer."""
        T, B, H, D, dt = self.T, self.B, self.H, self.D, self.dtype
        acc = acc_dtype(dt)
        return dict(
            lens=cuda.to_device(self.lens),
            gx=cuda.to_device(self.gx), unit_params=cuda.to_device(self.unit_params), bias=cuda.to_device(self.bias),
            R_fwd=cuda.to_device(self.R[0]), R_rev=cuda.to_device(self.R[1]),
            h_in=cuda.to_device(self.h0.astype(acc)), h_out=cuda.device_array((D, B, H), acc),
            c=cuda.to_device(self.c0.astype(acc)),
            y=cuda.to_device(np.zeros((T, B, D * H), dt)),
            acts=cuda.to_device(np.zeros((D, T, B, 4 * H), dt)), cs=cuda.to_device(np.zeros((D, T, B, H), dt)))


def launch_step(kernel, s, buf, H, B, D):
    """One launch = one step of both directions: grid (ceil(H / threads), B, D)."""
    tpb = threads(H)
    kernel[(blocks(H, tpb), B, D), tpb](s, buf["lens"], buf["gx"], buf["unit_params"], buf["R_fwd"],
                                         buf["R_rev"], buf["h_in"], buf["h_out"], buf["c"], buf["y"], buf["acts"],
                                         buf["cs"])


def check_one_step(pb: Problem):
    """Step s = 0 in the kernel against numbarnn.reference.lstm.forward on the active rows."""
    kernel = jit(cell_steps.make_forward_step, LSTM, str(pb.dtype), False)      # cached: compiled once
    buf = pb.device_buffers()
    launch_step(kernel, 0, buf, pb.H, pb.B, pb.D)
    h_out, c_out, y = buf["h_out"].copy_to_host(), buf["c"].copy_to_host(), buf["y"].copy_to_host()
    for d in range(pb.D):
        for b in range(pb.B):
            if pb.lens[b] == 0:        # inactive row: state copied through, no output written
                assert np.array_equal(h_out[d, b], pb.h0[d, b]) and np.array_equal(c_out[d, b], pb.c0[d, b])
                assert not y[:, b].any()
                continue
            t = 0 if d == 0 else pb.lens[b] - 1                               # reverse: last valid step first
            gx = pb.gx[d, t, b][None] + pb.bias[d, 0]                         # [1, 4H]
            gh = pb.h0[d, b][None] @ pb.R[d].T + pb.bias[d, 1]                # [1, 4H]
            m, c_new, _ = ref_lstm.forward(gx, gh, pb.h0[d, b][None], pb.c0[d, b][None])
            assert relative_error(h_out[d, b], m[0]) < 1e-13, (d, b)
            assert relative_error(c_out[d, b], c_new[0]) < 1e-13, (d, b)
            assert relative_error(y[t, b, d * pb.H:(d + 1) * pb.H], m[0]) < 1e-13, (d, b, t)
    print(f"  one launch, grid {(blocks(pb.H, threads(pb.H)), pb.B, pb.D)} x {threads(pb.H)} threads: step 0 of "
          f"both directions equals the NumPy cell (lengths {pb.lens.tolist()}; the reverse direction starts at "
          f"t = len-1; the len-0 row kept its state)")


def run_layer(pb: Problem, kernel):
    """The whole time loop by hand, as numbarnn/kernels/driver.py runs it -> (y, hT, cT) on the host."""
    buf = pb.device_buffers()
    for s in range(int(pb.lens.max(initial=0))):         # past max(len) every row would only carry its state
        launch_step(kernel, s, buf, pb.H, pb.B, pb.D)
        buf["h_in"], buf["h_out"] = buf["h_out"], buf["h_in"]       # double buffer: swap, no copy
    return buf["y"].copy_to_host(), buf["h_in"].copy_to_host(), buf["c"].copy_to_host()


def check_time_loop(pb: Problem):
    kernel = jit(cell_steps.make_forward_step, LSTM, str(pb.dtype), False)
    y, hT, cT = run_layer(pb, kernel)
    y_ref, hT_ref, cT_ref, _, _ = ops.cudnn_rnn_v3(pb.x, pb.h0, pb.c0, pb.params, pb.lens, rnn_mode="lstm",
                                                   direction="bidirectional", is_training=False,
                                                   backend="reference")
    tol, _ = TOLERANCES[np.dtype(pb.dtype)]      # SPEC 10, the tolerance every check of numbarnn uses
    for name, out, ref in (("output", y, y_ref), ("output_h", hT, hT_ref), ("output_c", cT, cT_ref)):
        err = relative_error(out, ref)
        assert err <= tol, f"{name}: relative error {err:.1e} against the reference op"
    print(f"  {int(pb.lens.max())} launches (one per step) reproduce ops.cudnn_rnn_v3(backend='reference'): "
          f"output, output_h, output_c equal to {tol:.0e}")


# ---------------------------------------------------------------------------------------------------
# 3. The unfused alternative, for comparison: gh = h @ R^T by a GEMM, then a pointwise cell kernel
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_lstm_pointwise(dtype):
    """The cell alone: gh (R h, computed by a separate GEMM launch per direction) comes in from global memory."""
    acc = acc_dtype(dtype).type
    sigmoid, tanh, _ = activations(dtype)

    def lstm_pointwise(
        s,        # int64            step index
        lens,     # [B] int32        sequence lengths
        gx,       # [D, T, B, 4H]    W x_t (no bias)
        gh,       # [D, B, 4H] acc   R h of this step (no bias), written by the GEMM launches
        bias,     # [D, 2, 4H]       bW, bR
        h_in,     # [D, B, H] acc    h entering the step
        h_out,    # [D, B, H] acc    h leaving it
        c,        # [D, B, H] acc    cell state, updated in place
        y,        # [T, B, D*H]      layer output
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = c.shape[2]
        if j >= H:
            return
        if s >= lens[b]:
            h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        ki, kf, kg, ko = j, H + j, 2 * H + j, 3 * H + j          # unit j's row in gates i, f, g, o
        a_i = acc(gx[d, t, b, ki]) + acc(bias[d, 0, ki]) + acc(bias[d, 1, ki]) + gh[d, b, ki]
        a_f = acc(gx[d, t, b, kf]) + acc(bias[d, 0, kf]) + acc(bias[d, 1, kf]) + gh[d, b, kf]
        a_g = acc(gx[d, t, b, kg]) + acc(bias[d, 0, kg]) + acc(bias[d, 1, kg]) + gh[d, b, kg]
        a_o = acc(gx[d, t, b, ko]) + acc(bias[d, 0, ko]) + acc(bias[d, 1, ko]) + gh[d, b, ko]
        i = sigmoid(a_i)
        f = sigmoid(a_f)
        g = tanh(a_g)
        o = sigmoid(a_o)
        c_new = f * c[d, b, j] + i * g
        m = o * tanh(c_new)
        c[d, b, j] = c_new
        h_out[d, b, j] = m
        y[t, b, d * H + j] = m

    return lstm_pointwise


def run_layer_unfused(pb: Problem, buf, gh, pointwise):
    """D GEMM launches + 1 pointwise launch per step."""
    tpb = threads(pb.H)
    for s in range(int(pb.lens.max(initial=0))):
        gemm(buf["h_in"][0], buf["R_fwd"], gh[0], trans_b=True)          # gh[0] = h[0] @ R_fwd^T
        gemm(buf["h_in"][1], buf["R_rev"], gh[1], trans_b=True)          # gh[1] = h[1] @ R_rev^T
        pointwise[(blocks(pb.H, tpb), pb.B, pb.D), tpb](s, buf["lens"], buf["gx"], gh, buf["bias"], buf["h_in"],
                                                        buf["h_out"], buf["c"], buf["y"])
        buf["h_in"], buf["h_out"] = buf["h_out"], buf["h_in"]
    return buf


def check_unfused(pb: Problem):
    pointwise = jit(make_lstm_pointwise, str(pb.dtype))
    buf = pb.device_buffers()
    gh = cuda.device_array((pb.D, pb.B, 4 * pb.H), acc_dtype(pb.dtype))   # [D, B, 4H] the round trip
    run_layer_unfused(pb, buf, gh, pointwise)
    y_fused, _, _ = run_layer(pb, jit(cell_steps.make_forward_step, LSTM, str(pb.dtype), False))
    err = relative_error(buf["y"].copy_to_host(), y_fused)
    assert err <= TOLERANCES[np.dtype(pb.dtype)][0], f"unfused vs fused: relative error {err:.1e}"
    print(f"  unfused (2 GEMM launches + 1 pointwise launch per step) gives the same output (relative error "
          f"{err:.0e}), with 3x the launches and gh [D, B, 4H] written to and read back from global memory")


# ---------------------------------------------------------------------------------------------------
# 4. Launches per step in numbarnn's driver
# ---------------------------------------------------------------------------------------------------

def check_launch_counts(pb: Problem):
    y, hT, cT, reserve, host_reserved = ops.cudnn_rnn_v3(pb.x, pb.h0, pb.c0, pb.params, pb.lens, rnn_mode="lstm",
                                                         direction="bidirectional", backend="cuda")
    ops.cudnn_rnn_backprop_v3(pb.x, pb.h0, pb.c0, pb.params, pb.lens, y, hT, cT, np.ones_like(y),
                              np.zeros_like(hT), np.zeros_like(cT), reserve, host_reserved, rnn_mode="lstm",
                              direction="bidirectional", backend="cuda")
    log = cuda_backend.last_launch_count()
    fwd, bwd = log["forward"], log["backward"]
    assert fwd.per_step == 1, f"forward: expected 1 launch per step, got {fwd.per_step}"
    assert bwd.per_step == 2, f"backward: expected 2 launches per step, got {bwd.per_step}"
    assert fwd.by_kernel["forward_step"] == fwd.steps == int(pb.lens.max())
    print(f"  driver, training forward: {fwd.total} launches in all, {fwd.per_step} per step x {fwd.steps} steps "
          f"(by kernel: {fwd.by_kernel})")
    print(f"  driver, backward: {bwd.total} launches in all, {bwd.per_step} per step (pointwise backward + "
          f"dh_prev = dgh @ R) x {bwd.steps} steps")


def check_projection_launches(rng):
    """With num_proj the step needs h' = W_proj m of ALL units of the row: a second launch per step."""
    T, B, I, H, P = 2, 2, 2, 3, 2
    params = (rng.standard_normal(ops.cudnn_rnn_params_size(1, H, I, num_proj=P)) * 0.5).astype(np.float64)
    x = rng.standard_normal((T, B, I))
    h0, c0 = np.zeros((1, B, P)), np.zeros((1, B, H))
    ops.cudnn_rnn_v3(x, h0, c0, params, num_proj=P, is_training=False, backend="cuda")
    fwd = cuda_backend.last_launch_count()["forward"]
    assert fwd.per_step == 2, f"projection: expected 2 launches per step, got {fwd.per_step}"
    print(f"  with a projection (num_proj={P}): {fwd.per_step} launches per step (cell, then project: a "
          f"thread needs every unit's m, which only a new launch (a grid-wide barrier) guarantees)")


# ---------------------------------------------------------------------------------------------------
# 5. Benchmark
# ---------------------------------------------------------------------------------------------------

def numpy_layer(pb: Problem):
    """The same time loop in NumPy (reference cells), for the timing."""
    h, c = pb.h0.copy(), pb.c0.copy()
    for s in range(int(pb.lens.max(initial=0))):
        for d in range(pb.D):
            b = np.flatnonzero(s < pb.lens)
            t = s if d == 0 else pb.lens[b] - 1 - s
            gh = h[d, b] @ pb.R[d].T + pb.bias[d, 1]
            m, c_new, _ = ref_lstm.forward(pb.gx[d, t, b] + pb.bias[d, 0], gh, h[d, b], c[d, b])
            h[d, b], c[d, b] = m, c_new
    return h


def benchmark(quick: bool, rng):
    if SIM:
        T, B, I, H = (3, 2, 2, 4) if quick else (4, 3, 3, 8)
    else:
        T, B, I, H = (50, 32, 256, 256) if quick else (100, 64, 512, 512)
    pb = Problem(T, B, I, H, [T] * B, rng, np.float32)
    reps = 1 if quick else 3
    fused = jit(cell_steps.make_forward_step, LSTM, "float32", False)
    pointwise = jit(make_lstm_pointwise, "float32")
    buf = pb.device_buffers()
    gh = cuda.device_array((pb.D, pb.B, 4 * pb.H), np.float32)

    def run_fused():
        for s in range(T):
            launch_step(fused, s, buf, H, B, pb.D)

    rows = [("NumPy time loop (host, reference cells)", timed_ms(lambda: numpy_layer(pb), reps), 0),
            ("fused step kernel", timed_ms(run_fused, reps), 1),
            ("GEMM per direction + pointwise kernel", timed_ms(lambda: run_layer_unfused(pb, buf, gh, pointwise), reps),
             pb.D + 1)]
    print(f"  bidirectional LSTM layer, time loop only (gx precomputed), T={T} B={B} H={H} float32, median of {reps}")
    print(f"  device: {device_name()}")
    for name, ms, launches in rows:
        per_step = f"{launches} launch(es)/step" if launches else "host"
        print(f"    {name:<42} {ms:9.2f} ms  ({ms / T:7.3f} ms/step, {per_step})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    rng = np.random.default_rng(2)
    print(f"running on: {device_name()}")
    print("1. the fused step kernel")
    show_kernel()
    pb = Problem(T=3, B=3, I=2, H=4, lens=[3, 2, 0], rng=rng)
    print("2. one step against the NumPy cell, then the whole time loop")
    check_one_step(pb)
    check_time_loop(pb)
    print("3. unfused: recurrent GEMM + pointwise kernel")
    check_unfused(pb)
    print("4. launches per step")
    check_launch_counts(pb)
    if not quick:
        check_projection_launches(rng)
    print("5. benchmark")
    benchmark(quick, rng)
    print("tutorial 02: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

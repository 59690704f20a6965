"""The simulator memory profiler (numbarnn.analysis.profiler) on known answers, and its roofline model.

Known answers use blocks of >= 32 threads so full warps exist (plus one partial warp).  float32 throughout:
a warp's 32 x 4 bytes = 128 bytes = 4 sectors of 32 bytes.
"""
import json
import re

import numpy as np
import pytest
from numba import cuda

from numbarnn.cells import get_cell
from numbarnn.analysis import profiler, roofline
from numbarnn.kernels import common, step_v2, v3_slices
from numbarnn.kernels.cell_steps import make_forward_step
from numbarnn.kernels.recurrent import make_recurrent_backward


@cuda.jit
def copy(a, b):
    i = cuda.grid(1)
    if i < a.shape[0]:
        b[i] = a[i]


@cuda.jit
def strided_read(a, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i * 32]


@cuda.jit
def broadcast_read(a, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[3]


@cuda.jit
def read_twice(a, out):
    i = cuda.grid(1)
    if i < a.shape[0]:
        x = a[i]
        y = a[i]
        out[i] = x + y


@cuda.jit
def shared_reverse(a, out):
    sh = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    sh[t] = a[i]
    cuda.syncthreads()
    out[i] = sh[63 - t]


@cuda.jit
def shared_conflict(out):
    sh = cuda.shared.array(1024, np.float32)
    t = cuda.threadIdx.x
    sh[t * 32] = np.float32(t)          # every lane in bank 0: 32 wavefronts
    cuda.syncthreads()
    out[t] = sh[t * 32]


def make_row_reads(alignment, first):
    """Each thread sums 4 consecutive words of its own row (rows 36 words apart) from column `first`: an
    unrolled loop NVVM fuses into one LDS.128 when the array is 16-byte aligned and `first` a multiple of 4."""
    @cuda.jit
    def row_reads(out):
        sh = cuda.shared.array((32, 36), np.float32, alignment=alignment)
        t = cuda.threadIdx.x
        for k in range(36):
            sh[t, k] = np.float32(k)
        cuda.syncthreads()
        acc = np.float32(0.0)
        for v in range(4):
            acc += sh[t, first + v]
        out[t] = acc
    return row_reads


@cuda.jit
def count(out):
    cuda.atomic.add(out, 0, np.float32(1.0))


@cuda.jit
def row_view(a, out):
    i = cuda.grid(1)
    row = a[1]                          # a view taken inside the kernel
    if i < row.shape[0]:
        out[i] = row[i]


def f32(n):
    return cuda.to_device(np.arange(n, dtype=np.float32))


def test_coalesced_copy_is_fully_coalesced():
    a, b = f32(128), cuda.device_array(128, np.float32)
    st = profiler.profile_launch(copy, 2, 64, a, b)
    for kind in ("load", "store"):
        row = st["global_"][kind]
        assert row["requests"] == 4                    # 2 blocks x 2 warps
        assert row["sectors_per_request"] == 4.0
        assert row["coalescing"] == 1.0
    assert st["dram_bytes"] == 2 * 128 * 4
    np.testing.assert_array_equal(b.copy_to_host(), np.arange(128, dtype=np.float32))


def test_stride_32_read_is_one_eighth_coalesced():
    a, out = f32(64 * 32), cuda.device_array(64, np.float32)
    st = profiler.profile_launch(strided_read, 2, 32, a, out)
    load = st["global_"]["load"]
    assert load["requests"] == 2
    assert load["sectors_per_request"] == 32.0
    assert load["coalescing"] == 1 / 8
    assert st["global_"]["store"]["sectors_per_request"] == 4.0
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(64, dtype=np.float32) * 32)


def test_broadcast_read_is_one_sector_per_warp():
    a, out = f32(64), cuda.device_array(96, np.float32)
    st = profiler.profile_launch(broadcast_read, 3, 32, a, out)
    load = st["global_"]["load"]
    assert load["requests"] == 3 and load["sectors"] == 3
    assert load["coalescing"] == 4 / 32                # 4 distinct bytes used of the 32 moved
    assert st["l2_bytes"] - st["global_"]["store"]["sectors"] * 32 == 3 * 32   # one sector per block


def test_partial_warp():
    a, b = f32(48), cuda.device_array(48, np.float32)
    st = profiler.profile_launch(copy, 1, 48, a, b)   # warp 0: 32 lanes, warp 1: 16 lanes
    load = st["global_"]["load"]
    assert load["requests"] == 2
    assert load["sectors"] == 4 + 2
    assert load["coalescing"] == 1.0
    assert st["warps_per_block"] == 2


def test_distinct_bytes_count_an_array_read_twice_once():
    a, out = f32(256), cuda.device_array(256, np.float32)
    st = profiler.profile_launch(read_twice, 4, 64, a, out)
    assert st["global_"]["load"]["requests"] == 2 * 8              # two load instructions per warp
    assert st["dram_bytes"] == a.nbytes + out.nbytes               # a counted once
    assert st["l1_bytes"] == 2 * a.nbytes + out.nbytes             # every request's sectors
    assert st["l2_bytes"] == a.nbytes + out.nbytes                 # each block re-reads only its own sectors
    np.testing.assert_array_equal(out.copy_to_host(), 2 * np.arange(256, dtype=np.float32))


def test_shared_memory_bytes_and_bank_conflicts():
    a, out = f32(128), cuda.device_array(128, np.float32)
    st = profiler.profile_launch(shared_reverse, 2, 64, a, out)
    sh = st["shared"]
    assert sh["bytes_per_block"] == 64 * 4
    assert sh["load_bytes"] == sh["store_bytes"] == 128 * 4
    assert sh["requests"] == 8 and sh["wavefronts"] == 8            # conflict-free
    expect = np.arange(128, dtype=np.float32).reshape(2, 64)[:, ::-1].ravel()
    np.testing.assert_array_equal(out.copy_to_host(), expect)

    out = cuda.device_array(32, np.float32)
    st = profiler.profile_launch(shared_conflict, 1, 32, out)
    assert st["shared"]["bytes_per_block"] == 1024 * 4
    assert st["shared"]["requests"] == 2 and st["shared"]["wavefronts"] == 2 * 32
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(32, dtype=np.float32))


def test_vector_loads_are_one_request_where_nvvm_fuses_them():
    """4 consecutive words per lane from a 16-byte aligned array, starting on a 16-byte boundary: one request
    (an LDS.128) of 32 rows x 16 bytes, rows 36 words apart: 4 words per bank, 4 wavefronts for 512 bytes.
    Without an alignment, or from a word off a 16-byte boundary, 4 scalar requests, each 4-way conflicted (the
    rows start in 8 banks); 8-byte aligned from word 2: 2 requests (LDS.64) of 4 wavefronts."""
    for alignment, first, requests, wavefronts in ((16, 4, 1, 4), (None, 4, 4, 16), (16, 1, 4, 16), (8, 2, 2, 8)):
        out = cuda.device_array(32, np.float32)
        st = profiler.profile_launch(make_row_reads(alignment, first), 1, 32, out)
        loads = st["shared"]["requests"] - 36                  # 36 store requests, one a column, 4-way each
        assert (loads, st["shared"]["wavefronts"] - 36 * 4) == (requests, wavefronts), (alignment, first)
        np.testing.assert_array_equal(out.copy_to_host(), np.full(32, 4 * first + 6, np.float32))
    with pytest.raises(ValueError, match="alignment"):
        profiler.profile_launch(make_row_reads(12, 0), 1, 32, cuda.device_array(32, np.float32))


def test_atomics_are_one_request_per_warp_and_give_the_same_result():
    out = cuda.to_device(np.zeros(1, np.float32))
    st = profiler.profile_launch(count, 2, 64, out)
    atom = st["global_"]["atomic"]
    assert atom["requests"] == 4 and atom["accesses"] == 128 and atom["sectors"] == 4
    assert out.copy_to_host()[0] == 128


def test_views_and_tags_use_device_addresses():
    host = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    a, out = cuda.to_device(host), cuda.device_array(64, np.float32)
    with profiler.recording() as rec:
        rec.tag("second row", a, 64 * 4, 2 * 64 * 4)
        row_view[2, 32](a, out)                            # view inside the kernel
        copy[2, 32](a.reshape(128)[64:], out)              # a view passed from the host
    inside, passed = rec.launches
    for st in (inside, passed):
        assert st["global_"]["load"]["sectors_per_request"] == 4.0
        assert st["tags"]["second row"]["dram_bytes"] == 256
        assert st["tags"]["second row"]["requests"] == 2
    np.testing.assert_array_equal(out.copy_to_host(), host[1])


def test_recording_restores_the_simulator():
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi
    from numbarnn.kernels import target
    before = (sim_kernel.FakeCUDAKernel.__call__, kernelapi.FakeCUDAShared.array,
              kernelapi.FakeCUDAAtomic.add, target.current())
    a, b = f32(8), cuda.device_array(8, np.float32)
    with pytest.raises(ZeroDivisionError), profiler.recording(geometry="gpu"):
        assert target.current() == target.Target(simulator=False, gpu_model=True)
        assert common.threads(1000) == 128 and common.SIMULATOR        # GPU launch sizes, in the simulator
        copy[1, 8](a, b)
        raise ZeroDivisionError
    after = (sim_kernel.FakeCUDAKernel.__call__, kernelapi.FakeCUDAShared.array,
             kernelapi.FakeCUDAAtomic.add, target.current())
    assert before == after and after[-1] == target.PROCESS
    with pytest.raises(ValueError, match="geometry"), profiler.recording(geometry="big"):
        pass


# ---------------------------------------------------------------------------------------------------
# v1 step kernels: the analysis (32 sectors per R request; B x |R| per step)
# ---------------------------------------------------------------------------------------------------

def _forward_step_launch(H, B):
    """One v1 LSTM forward step (D=1, T=1, P=H=I) with GPU geometry: 128-thread blocks, grid (.., B, 1)."""
    cell = get_cell("lstm")
    rng = np.random.default_rng(0)
    G, S = cell.G, cell.S

    def dev(*shape):
        return cuda.to_device(rng.standard_normal(shape).astype(np.float32))

    R = dev(G * H, H)
    args = dict(s=0, lens=cuda.to_device(np.ones(B, np.int32)), gx=dev(1, 1, B, G * H),
                unit_params=dev(1, 2 * G + cell.V, H), R_fwd=R, R_rev=R, h_in=dev(1, B, H),
                h_out=cuda.device_array((1, B, H), np.float32), c=dev(1, B, H), y=dev(1, B, H),
                acts=dev(1, 1, B, S * H), cs=dev(1, 1, B, H))
    kernel = cuda.jit(make_forward_step(cell, "float32", False))
    names = kernel.py_func.__code__.co_varnames[:kernel.py_func.__code__.co_argcount]
    threads = common.threads(H, simulator=False)
    return kernel, (common.blocks(H, threads), B, 1), threads, [args[n] for n in names], R


def test_v1_lstm_forward_step_reads_R_uncoalesced_once_per_batch_row():
    H, B = 32, 4
    kernel, grid, block, args, R = _forward_step_launch(H, B)
    with profiler.recording() as rec:
        rec.tag("R", R)
        kernel[grid, block](*args)
    r = rec.launches[0]["tags"]["R"]
    assert r["sectors_per_request"] == 32.0                   # one sector per lane: rows are 128 B apart
    assert r["coalescing"] == 1 / 8
    assert r["l2_bytes"] == B * R.nbytes                      # B x |R| per step
    assert r["dram_bytes"] == R.nbytes
    model = roofline.v1_step_traffic(H, H, B)["forward_step"]  # the model's formula = the measurement
    assert model["R_l2"] == r["l2_bytes"] and model["R_l1"] == r["l1_bytes"]


def test_v1_recurrent_backward_reads_R_coalesced_once_per_batch_row():
    H, B, G = 32, 3, 4
    rng = np.random.default_rng(1)
    R = cuda.to_device(rng.standard_normal((G * H, H)).astype(np.float32))
    dgh = cuda.to_device(rng.standard_normal((1, 1, B, G * H)).astype(np.float32))
    dh_in = cuda.to_device(np.zeros((1, B, H), np.float32))
    dh_out = cuda.to_device(np.zeros((1, B, H), np.float32))
    kernel = cuda.jit(make_recurrent_backward("float32"))
    with profiler.recording() as rec:
        rec.tag("R", R)
        kernel[(1, B, 1), 32](0, cuda.to_device(np.ones(B, np.int32)), dgh, R, R, dh_in, dh_out)
    r = rec.launches[0]["tags"]["R"]
    assert r["sectors_per_request"] == 4.0 and r["coalescing"] == 1.0
    assert r["l2_bytes"] == B * R.nbytes
    model = roofline.v1_step_traffic(H, H, B)["recurrent_backward"]
    assert model["R_l2"] == r["l2_bytes"] and model["R_l1"] == r["l1_bytes"]
    expect = dgh.copy_to_host()[0, 0] @ R.copy_to_host()
    np.testing.assert_allclose(dh_out.copy_to_host()[0], expect, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# whole op calls, the CLI, the model
# ---------------------------------------------------------------------------------------------------

def test_run_profile_of_an_op_call():
    result = profiler.run_profile(units=16, input_size=8, batch=3, time=2, step_version=1)
    assert result["step_version"] == 1
    fwd, bwd = result["phases"]["forward"], result["phases"]["backward"]
    assert fwd["launches"] == fwd["driver_launches"] and bwd["launches"] == bwd["driver_launches"]
    assert fwd["launches_per_step"] == 1 and bwd["launches_per_step"] == 2
    assert fwd["matrices"]["R"]["times_matrix"] == 3          # B x |R| per step
    assert fwd["matrices"]["R"]["sectors_per_request"] == 16  # 16 lanes, rows 64 B apart: one sector each
    assert bwd["matrices"]["R"]["times_matrix"] == 3
    assert fwd["model"]["per_step_us"] > 0 and "MODEL" in fwd["model"]["note"]
    text = profiler.format_profile(result)
    assert "R " in text and "roofline MODEL" in text and "lstm_forward_step *" in text
    json.dumps(result)


def test_run_profile_of_the_v2_step_kernels():
    """v2 (the GPU default where v3 cannot run) reads R once per 8-row tile per step, coalesced; v1 reads it
    once per row.  (The backward's figures: test_measured_v2_figures_are_the_models, on the kernels alone.)"""
    B = 9                                                    # two row tiles of 8, the second partial
    result = profiler.run_profile(units=32, input_size=2, batch=B, time=2, step_version=2, phases=("forward",))
    assert result["step_version"] == 2
    fwd = result["phases"]["forward"]
    assert fwd["launches"] == fwd["driver_launches"] and fwd["launches_per_step"] == 1
    assert fwd["kernels"]["lstm_forward_step_v2"]["step_kernel"]
    assert fwd["matrices"]["R"]["times_matrix"] == 2                 # ceil(B / 8) row tiles, not B = 9
    assert fwd["matrices"]["R"]["coalescing"] == 1.0                 # 128-byte rows; v1: 1/8
    v1 = profiler.run_profile(units=32, input_size=2, batch=B, time=1, step_version=1, phases=("forward",))
    assert v1["phases"]["forward"]["matrices"]["R"]["times_matrix"] == B
    assert "step kernels v2" in profiler.format_profile(result)
    with pytest.raises(ValueError, match="step_version"):
        profiler.run_profile(step_version=4)


@pytest.mark.parametrize("proj", [0, 8])
def test_run_profile_of_the_persistent_v3_kernels(proj):
    """v3 in the profiler (the GPU's slices, every block at once: numbarnn's simulator fix): one launch per layer
    and phase, R read once per layer (1/T x |R| per step; v2 reads it every step), coalesced; with a projection
    W_proj once per layer too, and record_h_prev after the backward."""
    T = 3
    result = profiler.run_profile(units=16, input_size=2, batch=3, time=T, step_version=3, proj=proj)
    assert result["step_version"] == 3
    for phase in ("forward", "backward"):
        s = result["phases"][phase]
        name = f"lstm_{phase}_persistent_v3" + ("_proj" if proj else "")
        assert s["kernels"][name]["launches"] == 1 and s["kernels"][name]["step_kernel"], s["kernels"]
        assert s["launches"] == s["driver_launches"] and s["launches_per_step"] == pytest.approx(1 / T)
        assert s["matrices"]["R"]["times_matrix"] == pytest.approx(1 / T), s["matrices"]["R"]
        assert s["matrices"]["R"]["coalescing"] == 1.0
        if proj:
            assert s["matrices"]["W_proj"]["times_matrix"] == pytest.approx(1 / T), s["matrices"]
    assert ("record_h_prev" in result["phases"]["backward"]["kernels"]) == bool(proj)
    assert "step kernels v3" in profiler.format_profile(result)


def test_run_profile_in_a_subprocess_and_bad_arguments():
    result = profiler._run_in_subprocess(dict(gpu="A100 SXM", geometry="gpu", phases=["forward"], cells=[],
                                              lines=1, mode="gru", units=4, input_size=3, batch=2, time=2,
                                              direction="bidirectional", lengths=[2, 1]))
    fwd = result["phases"]["forward"]
    assert list(result["phases"]) == ["forward"] and fwd["steps"] == 2
    assert fwd["matrices"]["R"]["bytes"] == 2 * 3 * 4 * 4 * 4         # both directions of the layer
    with pytest.raises(TypeError, match="unknown"):
        profiler.run_profile(hidden=3)
    with pytest.raises(ValueError, match="gpu"):
        profiler.run_profile(gpu="toaster")


def test_cli_profile_json(capsys):
    from numbarnn import cli
    code = cli.main(["profile", "--units", "4", "--batch", "2", "--time", "2", "--forward-only", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["units"] == 4 and out["phases"]["forward"]["launches_per_step"] == 1
    assert cli.main(["profile", "--blocklstm"]) == 2


def test_deepbench_model_is_labelled_and_scales_with_B():
    text = roofline.format_deepbench_model()
    assert "MODEL" in text and "not a measurement" in text
    rows = roofline.deepbench_model("H100 SXM")
    assert [(r["H"], r["B"], r["T"]) for r in rows] == list(roofline.DEEPBENCH)
    for r in rows:
        assert r["R_bytes_per_step_forward"] == r["B"] * r["R_bytes"]
    big = next(r for r in rows if (r["H"], r["B"], r["T"]) == (768, 16, 1024))
    assert big["forward_ms"] > big["published_cudnn_ms"]


def test_measured_v1_figures_are_the_models():
    figures = profiler.measure_v1_figures(H=32, B=2)
    assert {k: figures[k] for k in roofline.V1_MEASURED} == roofline.V1_MEASURED
    assert figures["forward_R_per_step_in_B_R"] == 1 and figures["backward_R_per_step_in_B_R"] == 1
    text = profiler.model_report(shapes=((256, 4, 1000),), measure=False)
    assert "MODEL" in text and "256" in text


def test_measured_v2_figures_are_the_models():
    """v2 at the GPU tiles (32 units x 8 rows): R once per row tile per step, coalesced, conflict-free shared
    memory; the model's formulas (roofline.v2_step_traffic) give exactly the measured totals."""
    H, B = 32, 10                                                      # two row tiles, the second partial
    figures = profiler.measure_v2_figures(H=H, B=B)
    assert {k: figures[k] for k in roofline.V2_MEASURED} == roofline.V2_MEASURED
    assert figures["R_sectors_per_request"] == 4 and figures["R_coalescing"] == 1.0
    assert figures["forward_R_per_step_in_R"] == figures["backward_R_per_step_in_R"] == -(-B // 8)
    model = roofline.v2_step_traffic(H, H, B)
    fwd, bwd = model["forward_step_v2"], model["backward_step_v2"]
    assert fwd["R_l2"] == step_v2.r_bytes_per_step(4, H, H, B, 1, 4) == figures["forward_R_l2"]
    assert bwd["R_l2"] == figures["backward_R_l2"]
    assert fwd["h_l2"] == figures["forward_h_l2"] and bwd["h_l2"] == figures["backward_dgh_l2"]
    assert fwd["smem_wavefronts"] == figures["forward_shared_wavefronts"]
    assert bwd["smem_wavefronts"] == figures["backward_shared_wavefronts"]


def test_measured_v3_step_is_the_models():
    """The v3 step body with a GPU-shaped slice of TJ = 2 units: R slice once, every block stages all of h,
    the k loop's loads are 16-byte vectors (the profiler fuses them as NVVM does), and the h tile's rows,
    padded to KC + 4 words, put the warp's 16 row groups' vectors in two wavefronts (256 bytes), the R slice's
    2 rows in one.  (Unpadded, rows 32 words apart, the model gives the 16-way conflict the first v3 had.)"""
    f = profiler.measure_v3_figures(H=4, P=32, B=2, TJ=2)
    sl = v3_slices.Slice(TJ=2, RG=32, RB=1, KC=32, KMAX=32)
    assert v3_slices.h_pitch(sl, "float32") == 36 and v3_slices.h_pitch(sl, "float64") == 34
    t = roofline.v3_traffic(4, 4, 2, sl, P=32)
    assert f["R_l2"] == t["slice"]["l2"] == 4 * 4 * 32 * 4 and f["R_sectors_per_request"] == 4
    assert f["h_l2"] == t["step"]["h_l2"] == 2 * 2 * 32 * 4 and f["h_sectors_per_request"] == 4
    assert f["shared_wavefronts"] == t["slice"]["smem_wavefronts"] + t["step"]["smem_wavefronts"]
    assert t["step"]["wf_h"] == 2 and t["step"]["wf_R"] == 1
    assert roofline.v3_traffic(4, 4, 2, sl, P=32, h_pitch=32)["step"]["wf_h"] == 16
    # the backward at H = P = 32: R's columns once (a warp covers 16 rows x 2 floats: 16 sectors a request,
    # each block touches 4x the bytes it uses, |R| from DRAM), every block stages all of dgh_{s+1} (G x h)
    b = roofline.v3_backward_traffic(32, 32, 2, sl)
    R_bytes = 4 * 32 * 32 * 4
    assert f["backward_R_l2"] == b["slice"]["l2"] == 4 * R_bytes and b["slice"]["dram"] == R_bytes
    assert f["backward_R_l1"] == b["slice"]["l1"] and f["backward_R_sectors_per_request"] == 16
    assert f["backward_dgh_l2"] == b["step"]["dgh_l2"] == 16 * 2 * 4 * 32 * 4
    assert f["backward_dgh_sectors_per_request"] == 4
    assert f["backward_shared_wavefronts"] == b["slice"]["smem_wavefronts"] + b["step"]["smem_wavefronts"]
    assert b["slice"]["wf_slice"] == 2 and b["step"]["wf_R"] == 1 and b["step"]["wf_h"] == 2


def test_deepbench_model_of_v1_v2_v3():
    text = profiler.model_report(measure=False)
    assert "MODEL" in text and "not a measurement" in text and "cuDNN" in text and "2.01" in text
    for v in (1, 2, 3):
        rows = [line for line in text.splitlines() if re.match(rf"\s*\d+\s+\d+\s+\d+\s+v{v}\b", line)]
        assert len(rows) == len(roofline.DEEPBENCH)
    assert "the target (within" in text and ("NOT met" in text or " met " in text)
    for r in roofline.deepbench_model(version=2):
        assert r["R_bytes_per_step_forward"] == step_v2.r_bytes_per_step(4, r["H"], r["H"], r["B"], 1, 4)
    h100 = roofline.deepbench_model("H100 SXM", version=3)
    assert all(r["runs"] == 3 for r in h100)                            # 226 registers: 4 blocks of 64 per SM
    assert all(r["backward_runs"] == 3 for r in h100)                   # the persistent backward as well
    assert all(r["backward_runs"] == 2 for r in roofline.deepbench_model("H100 SXM", version=2))
    a100 = {(r["H"], r["B"], r["T"]): r for r in roofline.deepbench_model("A100 SXM", version=3)}
    r = a100[(1024, 64, 100)]                                           # 512 blocks > 4 x 108: v2 instead
    assert r["runs"] == 2 and "v2 runs" in r["note"]
    v2 = {(r["H"], r["B"], r["T"]): r for r in roofline.deepbench_model("A100 SXM", version=2)}
    assert r["forward_ms"] == v2[(1024, 64, 100)]["forward_ms"]
    if r["backward_runs"] == 2:                                         # v2's backward too: the same time
        assert r["forward_backward_ms"] == v2[(1024, 64, 100)]["forward_backward_ms"]
    # v3: one launch and one R slice load per layer; each step costs its traffic + a grid barrier, no launch
    one, two = roofline.deepbench_model(shapes=((256, 4, 1000), (256, 4, 2000)), version=3)
    gemm_1000 = roofline._gemm_ms(roofline.GPUS["H100 SXM"], 1000, 4, 256, 256)[0]
    assert two["forward_ms"] - one["forward_ms"] == pytest.approx(1000 * one["forward_step_us"] / 1e3 + gemm_1000)


def test_cudnn_reference_point_is_the_bench_csvs():
    """roofline.CUDNN_H100_FASTEST (the H = 256, B = 4 target's point, where nothing is published) is read back
    from the H100 bench runs in bench/results/h100: cuDNN's fastest LSTM forward over every run (float32, no
    projection; the runs of other cells are beside them); the comparison lines
    state the target against it and point to the measurements."""
    import csv
    from pathlib import Path
    runs = sorted((Path(__file__).parent.parent / "bench" / "results" / "h100").glob("run*_bench*.csv"))
    assert len(runs) >= 9
    rows = [r for p in runs for r in csv.DictReader(p.read_text().splitlines())]
    for (H, B, T), fastest in roofline.CUDNN_H100_FASTEST.items():
        cudnn = [float(r["fwd_ms"]) for r in rows
                 if (int(r["H"]), int(r["B"]), int(r["T"])) == (H, B, T) and r["backend"] == "cudnn"
                 and r["mode"] == "lstm" and r["dtype"] == "float32" and int(r.get("P") or 0) == 0]
        assert len(cudnn) >= 9 and fastest == round(min(cudnn), 2), (H, cudnn)
    text = "\n".join(roofline.comparison_lines(roofline.deepbench_model(version=3), roofline.DEEPBENCH))
    assert "H=I=256 B=4 T=1000: model v3 forward" in text and "fastest MEASURED forward on an H100 (10.68 ms" in text
    assert "bench/results/gpu_h100.md" in text


def test_numbarnn_profile_from_a_process_without_the_simulator():
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != profiler.SIM_VAR}
    proc = subprocess.run([sys.executable, "-m", "numbarnn", "profile", "--units", "4", "--batch", "2", "--time", "2",
                           "--forward-only", "--gpu", "RTX 4090"], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "lstm_forward_step_v2 *" in proc.stdout and "roofline MODEL on RTX 4090" in proc.stdout

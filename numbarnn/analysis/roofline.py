"""A roofline MODEL of kernel time from the profiler's traffic figures and published GPU numbers.

Nothing here is a measurement of time: no GPU is involved.  For a group of launches

    t = launches x launch_gap + max(DRAM bytes / HBM bandwidth,
                                    L2 bytes / L2 bandwidth,
                                    L1 bytes / L1 bandwidth,
                                    FLOPs / fp32 peak)

with the byte counts from `numbarnn.analysis.profiler` (dram_bytes: distinct sectors of a launch; l2_bytes:
each block's distinct sectors; l1_bytes: every request's sectors) and FLOPs from the driver's launch plan.
It assumes perfect overlap and full occupancy, and ignores latency (one step of a small RNN is latency-bound
on a real GPU), so it is optimistic for small shapes; it is a ranking and an order of magnitude, not a timer.

`deepbench_model(..., version=1|2|3)` extrapolates the step kernels to the DeepBench shapes with traffic
formulas whose per-request figures (sectors per request of R, broadcast reads, shared-memory wavefronts) are
the ones the profiler measures on the simulator at a small shape (tests/test_profiler.py checks formula ==
measurement there: `v1_step_traffic` against measure_v1_figures, `v2_step_traffic` against measure_v2_figures,
`v3_traffic` and `v3_backward_traffic` against measure_v3_figures):

    v1  thread per (unit, row): R read B times per step, 32 sectors per forward request (uncoalesced)
    v2  tiles of 32 units x 8 rows: R read ceil(B/8) times per step (step_v2.r_bytes_per_step), coalesced,
        staged through shared memory (which shares the L1 pipe: counted in the L1 term)
    v3  persistent: the R slices loaded into shared memory once per layer; per step every block stages all of h,
        runs v2's epilogue, and waits at one grid barrier (GPU.grid_sync_us, approximate); when the blocks
        cannot all be co-resident on the GPU (v3_slices.v3_co_residency, v3_slices.plan's slice) v2 runs instead.
        The backward the same way with R's columns (`v3_backward_traffic`: it stages all of dgh, G times h)
`format_deepbench_model` prints the three side by side with the GPU targets' comparison points (cuDNN's and
haste's published times; at H = 256, B = 4, which has none, cuDNN's fastest forward measured on an H100,
`CUDNN_H100_FASTEST`) and says whether the model meets them.  Nothing in here is tuned to meet them; what the
kernels measured is in bench/results/gpu_h100.md.

The GPUs (`GPUS`) and the memory system's granularities come from numbarnn.kernels.gpus, the table the kernels'
plans read too.  The kernel modules (step_v2, step_v3, staging) are imported inside the functions that use them:
they import numba, and this module is read before a command chooses numba's CUDA simulator (`numbarnn bench`
reads DEEPBENCH, `numbarnn profile` the GPU names).

Why one file (over 500 lines): the model's one formula, the plans' figures it reads and its tables.
"""
from __future__ import annotations

from ..kernels.gpus import BANKS, GPU, GPUS, SECTOR, WARP, WAVEFRONT


#: published reference times (ms, fp32 LSTM training forward pass per DeepBench-style shape): the targets' points
PUBLISHED = {(768, 16, 1024): dict(cudnn=2.01, haste=18.41)}

#: the target's point where nothing is published: cuDNN 9.19's fastest training forward (ms, LSTM float32, one
#: layer, I = H, TF32 off) over the `numbarnn bench` runs on an H100 80GB HBM3 (bench/results/h100/, which
#: tests/test_profiler.py reads back)
CUDNN_H100_FASTEST = {(256, 4, 1000): 10.68}

#: the DeepBench-style LSTM shapes of the GPU targets: (H = I, B, T)
DEEPBENCH = ((512, 32, 100), (1024, 64, 100), (256, 4, 1000), (768, 16, 1024))


def bound_time(gpu: GPU, dram: float, l2: float, l1: float, flops: float) -> tuple[float, str]:
    """(seconds, which limit) of the roofline max."""
    terms = {"DRAM": dram / gpu.hbm, "L2": l2 / gpu.l2, "L1": l1 / gpu.l1, "FP32": flops / gpu.fp32}
    which = max(terms, key=terms.get)
    return terms[which], which


def _plan_family(name: str) -> str:
    base = name.split(" ")[0]
    return "gemm" if base.startswith("gemm") else base


def _family(name: str) -> str:
    name = name.removesuffix("_proj")
    return "gemm" if name.startswith("gemm") else name


def predict_phase(summary: dict, plan_rows: list, gpu_name: str) -> dict:
    """The model's time for one phase of a profiled op call (summary: profiler.summarize_phase's dict)."""
    gpu = GPUS[gpu_name]
    flops: dict = {}
    for r in plan_rows:
        fam = _plan_family(r["kernel"])
        flops[fam] = flops.get(fam, 0) + r["flops"] * r["launches"]
    rows, total, step_total = [], 0.0, 0.0
    for fam, k in summary["kernels"].items():
        f = flops.get(_family(fam), 0)
        t, which = bound_time(gpu, k["dram_bytes"], k["l2_bytes"], k["l1_bytes"], f)
        us = k["launches"] * gpu.launch_us + t * 1e6
        rows.append(dict(kernel=fam, launches=k["launches"], flops=f, bound=which, us=us,
                         launch_us=k["launches"] * gpu.launch_us))
        total += us
        if k["step_kernel"]:
            step_total += us
    per = summary["steps"] * summary["layers"]
    return dict(gpu=gpu_name, rows=rows, total_us=total, per_step_us=step_total / per if per else None,
                note="MODEL, not a measurement: roofline of the measured traffic (perfect overlap, full "
                     "occupancy, no latency) + launch gaps")


def format_phase_model(model: dict) -> str:
    lines = [f"roofline MODEL on {model['gpu']} (not a measurement; {model['note'].split(': ', 1)[1]}):"]
    for r in model["rows"]:
        lines.append(f"  {r['kernel']:<28} {r['launches']:>5} launches  {r['us']:>10.2f} us  "
                     f"({r['bound']}-bound, {r['launch_us']:.1f} us of launch gaps)")
    per = model["per_step_us"]
    lines.append(f"  predicted: {model['total_us']:.1f} us for the call"
                 + (f", {per:.2f} us per step (time-loop kernels, per layer)" if per is not None else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# extrapolation of the v1 step kernels (traffic formulas, per-request figures as measured)
# ---------------------------------------------------------------------------------------------------

#: per-request figures the profiler measures for v1 (float32, 128-thread blocks; see tests/test_profiler.py)
V1_MEASURED = dict(
    forward_R_sectors_per_request=32,      # thread j reads row g*H+j: one sector per lane
    backward_R_sectors_per_request=4,      # recurrent_backward: lanes read consecutive k: coalesced
    broadcast_sectors_per_request=1,       # h_in[d, b, k] (forward), dgh[d, t, b, gj] (backward): one address
)

V1_BLOCK = 128   # threads per block of the v1 step kernels on a GPU (numbarnn.kernels.common.threads)


def v1_step_traffic(H: int, I: int, B: int, G: int = 4, s: int = 4, measured=None) -> dict:
    """Per time step (one layer, one direction, no projection, P = H) of the v1 LSTM-style kernels:
    {kernel: dict(l1, l2, dram, flops)} in bytes / FLOPs.

    forward_step: R is read by every batch row's blocks: L2 traffic B x |R|; each R request moves
    `forward_R_sectors_per_request` sectors for 32 x s useful bytes (the L1 sees that many); h is a broadcast.
    The other arrays (gx, biases, reserve, c, h, y) are coalesced: their compulsory bytes.
    recurrent_backward: R once per batch row, coalesced; dgh a broadcast per warp.
    backward_step: pointwise, coalesced, compulsory bytes.
    """
    m = dict(V1_MEASURED, **(measured or {}))
    P = H
    R = G * H * P * s
    warps_f = -(-H // 32)
    blocks_f = -(-H // V1_BLOCK)
    other_f = B * (G * H + 2 * P + (G + 2) * H) * s          # gx row, h in/out, y, c, cs, acts (launch plan)
    fwd_R_l1 = B * warps_f * G * P * m["forward_R_sectors_per_request"] * 32       # every R request's sectors
    fwd_R_l2 = B * R                                                                # each batch row's blocks: all R
    fwd_l1 = fwd_R_l1 + B * warps_f * P * m["broadcast_sectors_per_request"] * 32 + other_f   # + h_in broadcasts
    fwd_l2 = fwd_R_l2 + B * blocks_f * P * s + other_f
    fwd = dict(l1=fwd_l1, l2=fwd_l2, dram=R + other_f, flops=B * (2 * G * H * P + 12 * H), R_l1=fwd_R_l1,
               R_l2=fwd_R_l2)
    warps_b = -(-P // 32)
    blocks_b = -(-P // V1_BLOCK)
    other_b = B * 2 * P * s
    rb_R_l1 = B * warps_b * G * H * m["backward_R_sectors_per_request"] * 32
    rb_R_l2 = B * R
    rb_l1 = rb_R_l1 + B * warps_b * G * H * m["broadcast_sectors_per_request"] * 32 + other_b   # + dgh broadcasts
    rb_l2 = rb_R_l2 + B * blocks_b * G * H * s + other_b
    rb = dict(l1=rb_l1, l2=rb_l2, dram=R + B * G * H * s + other_b, flops=2 * B * G * H * P, R_l1=rb_R_l1,
              R_l2=rb_R_l2)
    S = 4 if G == 4 else G
    bs = B * (2 * G * H + S * H + 3 * P) * s
    bstep = dict(l1=bs, l2=bs, dram=bs, flops=20 * B * H)
    return {"forward_step": fwd, "recurrent_backward": rb, "backward_step": bstep}



# ---------------------------------------------------------------------------------------------------
# v2 and v3: traffic formulas of the tiled / persistent step kernels (shared memory included)
# ---------------------------------------------------------------------------------------------------
#
# v2 and v3 stage operands through shared memory, and on NVIDIA GPUs since Volta shared memory and L1 are one
# pipe of 128 bytes per clock per SM: a warp's shared request takes one "wavefront" (clock) per distinct
# 4-byte word any one bank must serve (1 when conflict-free or a broadcast, n for an n-way bank conflict).  So
# the L1 term of the roofline is  global L1 sectors x 32 B + shared wavefronts x 128 B  (the `smem` entry,
# already in bytes, is added to `l1` by `step_time`).  The per-SM pipes (L1/shared, FP32) only work on the SMs
# that hold blocks: a grid of n < SMs blocks gets n/SMs of them (`step_time`'s `blocks`); L2 and DRAM are
# not scaled (optimistic for small grids).

#: per-request figures the profiler measures for the v2 step kernels (float32, GPU tiles; measure_v2_figures)
V2_MEASURED = dict(
    R_sectors_per_request=4,               # a warp stages 32 consecutive k of one row of R: 128 B
    h_sectors_per_request=4,               # h (forward) / dgh (backward) staged the same way
)


def bank_wavefronts(words) -> int:
    """Wavefronts of one warp's shared request: the most distinct 4-byte words any one bank serves."""
    per_bank: dict = {}
    for w in words:
        per_bank.setdefault(w % BANKS, set()).add(w)
    return max((len(v) for v in per_bank.values()), default=0)


def fewest_wavefronts(words) -> int:
    """The wavefronts a request of these 4-byte words needs at least: 32 distinct words (128 bytes) each."""
    return -(-len(set(words)) // BANKS)


def step_time(gpu: GPU, tr: dict, blocks: int) -> tuple[float, str]:
    """(microseconds, limit) of one launch's (or one step's) traffic `tr` on a grid of `blocks` blocks, without
    launch or barrier latency: the roofline max with the per-SM pipes scaled to the SMs that have work."""
    busy = min(1.0, blocks / gpu.sms)
    terms = {"DRAM": tr["dram"] / gpu.hbm, "L2": tr["l2"] / gpu.l2,
             "L1": (tr["l1"] + tr.get("smem", 0)) / (gpu.l1 * busy), "FP32": tr["flops"] / (gpu.fp32 * busy)}
    which = max(terms, key=terms.get)
    return terms[which] * 1e6, which


def _other_forward(B: int, H: int, P: int, G: int, s: int) -> int:
    """Compulsory bytes of a forward step besides R and the staged h (launch plan's figure, as v1): the gx row,
    h in/out, y, c, c', the saved activations."""
    return B * (G * H + 2 * P + (G + 2) * H) * s


def v2_step_traffic(H: int, I: int, B: int, G: int = 4, s: int = 4, measured=None, tiles=None) -> dict:
    """Per time step (one layer, one direction, no projection, P = H) of the v2 kernels (step_v2.py, GPU tiles:
    a block = TJ units x G gates x TB rows, TJ*RG threads):  {kernel: dict(l1, l2, dram, smem, flops, blocks,
    R_l2, R_l1, h_l2, smem_wavefronts)}.

    forward_step_v2, grid (ceil(H/TJ), ceil(B/TB)):
      R     every block stages its G*TJ rows of R once per step: step_v2.r_bytes_per_step = ceil(B/TB) x |R|
            (L2, and L1: `R_sectors_per_request` sectors per 32-lane request of 32 x s bytes);
      h     every block stages its rows of h: ceil(H/TJ) x B x P x s (coalesced the same way);
      other the epilogue's compulsory bytes (coalesced: a warp = 32 consecutive units of one row);
      smem  per K chunk the R tile (G*TJ*KC) and h tile (TB*KC) are stored, 32 words a request (one
            wavefront); per VW = 4 columns k of whole chunks (the tiles are zero past P) each warp loads G
            vectors of R (LDS.128: 32 rows x 16 bytes, rows staging.pitch(KC) words apart, `bank_wavefronts`:
            4) and RB of h (a broadcast: 1);
      FLOPs executed: 2 G P per (unit, row) of the padded tiles, + the cell (12 per unit and row).
    backward_step_v2 (fused: dh = dgh_{s+1} R, then the cell backward), grid (ceil(P/TJ), ceil(B/TB)):
      R     the same ceil(B/TB) x |R| per step, coalesced along k (R tile KC rows x TJ columns);
      dgh   every block stages its rows of dgh_{s+1}: ceil(P/TJ) x B x G*H x s;
      other the launch plan's compulsory bytes: B (3 G H + S H + 3 P) s;
      smem  per chunk of KC gate rows: R tile (KC*TJ) and dgh tile (TB*KC) stores; per gate row of whole chunks
            each warp loads 1 word of R (a row of the R tile: conflict-free), per 4 gate rows RB vectors of dgh
            (a broadcast): warps x ceil(G*H/KC) x (KC + KC/4 x RB) wavefronts.
    """
    from ..kernels import step_v2  # lazy: the kernels import numba.cuda
    from ..kernels.staging import pitch, vector_words  # lazy: the kernels import numba.cuda
    t = tiles or step_v2.GPU_TILES
    m = dict(V2_MEASURED, **(measured or {}))
    P = H
    TJ, RB, KC, TB, NT = t.TJ, t.RB, t.KC, t.TB, t.threads
    warps = -(-NT // WARP)
    by = -(-B // TB)
    VW = vector_words("float32")
    lanes = range(min(WARP, NT))
    wf_R = bank_wavefronts((lane % TJ) * pitch(KC, "float32") + v for lane in lanes for v in range(VW))
    wf_h = bank_wavefronts((lane // TJ * RB) * KC + v for lane in lanes for v in range(VW))

    def per_request(nbytes, key):              # L1 bytes of `nbytes` loaded 32 elements (one warp) a request
        return nbytes / (WARP * s) * m[key] * SECTOR

    # forward
    bx = -(-H // TJ)
    R_l2 = step_v2.r_bytes_per_step(G, H, P, B, 1, s, t)
    h_l2 = bx * B * P * s
    other = _other_forward(B, H, P, G, s)
    chunks = -(-P // KC)
    wavefronts = bx * by * (chunks * (G * TJ * KC + TB * KC) // WARP
                            + warps * chunks * KC // VW * (G * wf_R + RB * wf_h))
    fwd = dict(R_l2=R_l2, R_l1=per_request(R_l2, "R_sectors_per_request"), h_l2=h_l2,
               smem_wavefronts=wavefronts, smem=wavefronts * WAVEFRONT, blocks=bx * by)
    fwd.update(l2=R_l2 + h_l2 + other, l1=fwd["R_l1"] + per_request(h_l2, "h_sectors_per_request") + other,
               dram=R_l2 // by + B * P * s + other, flops=2 * G * bx * TJ * by * TB * P + 12 * B * H)
    # backward (fused)
    bx = -(-P // TJ)
    GH = G * H
    dgh_l2 = bx * B * GH * s
    other = B * (3 * GH + 4 * H + 3 * P) * s
    chunks = -(-GH // KC)
    wavefronts = bx * by * (chunks * (KC * TJ + TB * KC) // WARP + warps * chunks * (KC + KC // VW * RB * wf_h))
    bwd = dict(R_l2=R_l2, R_l1=per_request(R_l2, "R_sectors_per_request"), h_l2=dgh_l2,
               smem_wavefronts=wavefronts, smem=wavefronts * WAVEFRONT, blocks=bx * by)
    bwd.update(l2=R_l2 + dgh_l2 + other, l1=bwd["R_l1"] + per_request(dgh_l2, "h_sectors_per_request") + other,
               dram=R_l2 // by + B * GH * s + other, flops=2 * GH * bx * TJ * by * TB + 20 * B * H)
    return {"forward_step_v2": fwd, "backward_step_v2": bwd}


def v3_rows_by_k(B: int, sl) -> int:
    """The (row, k) pairs a v3 block's products run per gate and step (its units' FMAs per unit): each row
    tile's RN rows (TB without a split: the padded rows too) x the KMAX columns of the slice's capacity (zeros
    past P included), each chunk run by one split (`v3_splits`)."""
    from ..kernels.v3_slices import v3_splits  # lazy: the kernels import numba.cuda
    return sum(RN * sl.KMAX for RN, _ in v3_splits(B, sl))


def _v3_geometry(H: int, B: int, D: int, sl, s: int, h_pitch: int | None = None) -> tuple:
    """What the v3 forward and backward share, for slice `sl`: (blocks, warps per block, row tiles,
    wavefronts of a warp's R-slice load R_slice[g*TJ + jj, k .. k+VW-1] (rows staging.pitch(KMAX) words apart),
    of its staged-tile load tile[rg*RB + r, kk .. kk+VW-1] (rows h_pitch words apart, default v3_slices.h_pitch),
    VW (words a load: the k loop's loads are LDS.128, VW = 4 fp32 words, staging.pitch), how much more than its
    useful bytes an epilogue row's sector carries (TJ consecutive units per row), the h load's bank conflict
    (its wavefronts over the fewest its bytes need: 1 = conflict-free)."""
    from ..kernels import v3_slices  # lazy: the kernels import numba.cuda
    from ..kernels.staging import pitch, vector_words  # lazy: the kernels import numba.cuda
    TJ, RB, KMAX, TB, NT = sl.TJ, sl.RB, sl.KMAX, sl.TB, sl.threads
    VW = vector_words("float32")
    if h_pitch is None:
        h_pitch = v3_slices.h_pitch(sl, "float32")
    lanes = range(min(WARP, NT))
    R_pitch = pitch(KMAX, "float32")
    wf_R = bank_wavefronts((lane % TJ) * R_pitch + v for lane in lanes for v in range(VW))
    h_words = [(lane // TJ * RB) * h_pitch + v for lane in lanes for v in range(VW)]
    wf_h = bank_wavefronts(h_words)
    return (-(-H // TJ) * D, -(-NT // WARP), -(-B // TB), wf_R, wf_h, VW, max(1.0, SECTOR / (TJ * s)),
            wf_h // fewest_wavefronts(h_words))


def v3_product_wavefronts(B: int, sl, NG: int, NCH: int, per_k: int, NV: int, red_pitch: int, VW: int = 1) -> int:
    """Shared-memory wavefronts of one block's products over all of its row tiles (step_v3's step body: NG = 1,
    per_k = G*wf_R + RB*wf_h; its staged product: NG gates, per_k = wf_R + RB*wf_h), counted as the kernel runs
    them: per round TB*KC staged words stored (a warp's 32 lanes one row's 32 columns: one wavefront each); per
    round and VW columns k (one vector load each), per_k for every warp with a thread of a split that has a
    chunk in that round; with
    KS > 1 the reduction through `red` (rows red_pitch words apart): each live thread stores its NV x RB partial
    sums, split 0's threads load the other splits' (`bank_wavefronts` of the lanes' words)."""
    from ..kernels.v3_slices import v3_splits  # lazy: the kernels import numba.cuda
    TJ, RB, KC, TB, NT = sl.TJ, sl.RB, sl.KC, sl.TB, sl.threads
    total = 0
    for RN, KS in v3_splits(B, sl):
        RGN, NR = RN // RB, -(-NCH // KS)
        total += NG * NR * (TB * KC // WARP)
        for c in range(NR):
            for w0 in range(0, NT, WARP):
                if any((t // TJ) // RGN < KS and c * KS + (t // TJ) // RGN < NCH for t in range(w0, min(NT, w0 + WARP))):
                    total += NG * KC // VW * per_k
        if KS > 1:
            for w0 in range(0, NT, WARP):
                lanes = range(w0, min(NT, w0 + WARP))
                live = [t for t in lanes if (t // TJ) // RGN < KS]
                own = [t for t in lanes if t // TJ < RGN]
                for v in range(NV):
                    for r in range(RB):
                        if live:
                            total += bank_wavefronts((t // TJ * RB + r) * red_pitch + v * TJ + t % TJ for t in live)
                        for sp in range(1, KS):
                            if own:
                                total += bank_wavefronts(((sp * RGN + t // TJ) * RB + r) * red_pitch + v * TJ + t % TJ
                                                         for t in own)
    return total


def v3_traffic(H: int, I: int, B: int, sl, G: int = 4, s: int = 4, D: int = 1, P: int | None = None,
               h_pitch: int | None = None) -> dict:
    """The persistent v3 forward (step_v3.py) of one layer (no projection: P = H unless given) with slice `sl`:
    {"slice": traffic of loading the R slices (once per layer), "step": traffic of one step}.

    slice  every block loads its G*TJ rows of R into shared memory once: |R| from DRAM, coalesced along k
           (32 lanes, 32 consecutive k: 4 sectors); G*TJ*P words stored, 32 a request (rows staging.pitch apart).
    step   every block stages ALL B rows of h (it owns units, not rows): ceil(H/TJ) x B x P x s of L2
           traffic, coalesced; the epilogue (v2's) touches TJ consecutive units of 32/TJ rows a request, so
           each row's sector carries TJ*s useful bytes: its compulsory bytes x max(1, 32 / (TJ*s)) in L1/L2;
           smem (`v3_product_wavefronts`): per round of chunks TB*KC h words stored; per VW = 4 columns k
           (the k loop's LDS.128) each warp with a split that has a chunk loads G vectors of the R slice (rows
           staging.pitch apart: conflict-free) and RB of the h tile, whose rows are h_pitch words apart: the
           32/TJ row groups of a warp read 32/TJ distinct vectors, all in the same banks when h_pitch*s is a
           multiple of 128 (`bank_wavefronts` of the kernel's addresses); + one grid barrier (not traffic:
           GPU.grid_sync_us).
    h_pitch: words between h tile rows (default v3_slices.h_pitch(sl, "float32") = KC + 4, as the kernel lays it out: the
    model of an earlier layout with KC found the 16-way conflict that padding removed; h_pitch=KC shows it).
    """
    TJ, RB, KC = sl.TJ, sl.RB, sl.KC
    assert s == 4, "the bank arithmetic below is for 4-byte words (fp32)"
    P = H if P is None else P
    nb, _, _, wf_R, wf_h, VW, spread, conflict = _v3_geometry(H, B, D, sl, s, h_pitch)
    R_bytes = D * G * H * P * s
    slice_wf = nb * (-(-G * TJ * P // WARP))
    slice_ = dict(dram=R_bytes, l2=R_bytes, l1=R_bytes, smem_wavefronts=slice_wf, smem=slice_wf * WAVEFRONT,
                  flops=0, blocks=nb)
    h_l2 = nb * B * P * s
    other = D * _other_forward(B, H, P, G, s) * spread
    from ..kernels.v3_slices import red_pitch  # lazy: the kernels import numba.cuda
    step_wf = nb * v3_product_wavefronts(B, sl, 1, sl.KMAX // KC, G * wf_R + RB * wf_h, G, red_pitch(G, sl), VW)
    step = dict(h_l2=h_l2, l2=h_l2 + other, l1=h_l2 + other, dram=D * (B * P * s) + other / spread,
                smem_wavefronts=step_wf, smem=step_wf * WAVEFRONT, wf_R=wf_R, wf_h=wf_h, h_conflict=conflict,
                flops=2 * G * nb * TJ * v3_rows_by_k(B, sl) + 12 * D * B * H, blocks=nb)
    return {"slice": slice_, "step": step}


def v3_backward_traffic(H: int, I: int, B: int, sl, G: int = 4, s: int = 4, D: int = 1) -> dict:
    """The persistent v3 backward (step_v3.make_backward_body) of one layer (no projection: P = H) with slice
    `sl`: {"slice": loading R's columns (once per layer), "step": one step}.

    slice  every block loads the TJ columns j0 .. j0+TJ-1 of R: a warp request covers 32/TJ rows of TJ
           consecutive floats, ceil(TJ*s/32) sectors each (aligned: j0 is a multiple of TJ), so each block
           touches G*H rows x that many sectors (L2), |R| from DRAM once; stored into R_slice[g*TJ+jj, k]
           32 words a request, whose banks (jj*pitch(KMAX) + k) collide `wf_slice`-way (2-way at TJ = 2).
    step   every block stages ALL B rows of dgh_{s+1}, all G gates: ceil(H/TJ) x B x G*H x s of L2 traffic,
           coalesced (G times the forward's h); the epilogue's compulsory bytes (launch plan: B(3GH + SH + 3P)s)
           spread like the forward's; smem (`v3_product_wavefronts`): per gate and round TB*KC dgh words stored;
           per (gate, column k) each warp with a split that has a chunk loads one word of the R slice and RB of
           the dgh tile, and the splits' reduction; one grid barrier.
    """
    TJ, RB, KC, KMAX = sl.TJ, sl.RB, sl.KC, sl.KMAX
    assert s == 4, "the bank arithmetic below is for 4-byte words (fp32)"
    P = H
    GH = G * H
    nb, _, _, wf_R, wf_h, VW, spread, _ = _v3_geometry(H, B, D, sl, s)
    from ..kernels.staging import pitch  # lazy: the kernels import numba.cuda
    wf_slice = bank_wavefronts((e % TJ) * pitch(KMAX, "float32") + e // TJ for e in range(WARP))
    R_bytes = D * GH * P * s
    run = -(-TJ * s // SECTOR)                      # sectors of one row's TJ columns
    requests = nb * (-(-GH * TJ // WARP))
    slice_l2 = nb * GH * run * SECTOR
    slice_ = dict(dram=R_bytes, l2=slice_l2, l1=requests * (WARP // TJ) * run * SECTOR, wf_slice=wf_slice,
                  smem_wavefronts=requests * wf_slice, smem=requests * wf_slice * WAVEFRONT, flops=0, blocks=nb,
                  sectors_per_request=(WARP // TJ) * run)
    dgh_l2 = nb * B * GH * s
    other = D * B * (3 * GH + 4 * H + 3 * P) * s * spread
    from ..kernels.v3_slices import red_pitch  # lazy: the kernels import numba.cuda
    step_wf = nb * v3_product_wavefronts(B, sl, G, sl.KMAX // KC, wf_R + RB * wf_h, 1, red_pitch(G, sl), VW)
    step = dict(dgh_l2=dgh_l2, l2=dgh_l2 + other, l1=dgh_l2 + other, dram=D * B * GH * s + other / spread,
                smem_wavefronts=step_wf, smem=step_wf * WAVEFRONT, wf_R=wf_R, wf_h=wf_h,
                flops=2 * G * nb * TJ * v3_rows_by_k(B, sl) + 20 * D * B * H, blocks=nb)
    return {"slice": slice_, "step": step}


def _gemm_ms(gpu: GPU, T: int, B: int, H: int, I: int, G: int = 4) -> tuple[float, float]:
    """(forward, backward) GEMMs outside the time loop, ms: at half of fp32 peak (GEMM v3 reaches at most ~50%
    of it), 1 GEMM forward (gx = x W^T), 3 backward (dW, dx, dR)."""
    f = 2 * T * B * G * H * I / (0.5 * gpu.fp32) * 1e3
    return f, 3 * f


def deepbench_model(gpu_name: str = "H100 SXM", shapes=DEEPBENCH, measured=None, version: int = 1,
                    measured_v2=None) -> list[dict]:
    """Predicted LSTM times (fp32, one layer, unidirectional) of step kernel `version` at each (H = I, B, T):
    per step and for the whole call, forward (the time loop + the input GEMM) and forward + backward.  A MODEL.

    version 1: cell_steps.py + recurrent.py (2 launches per backward step); 2: step_v2.py (1 launch per
    forward step, T + 1 fused backward launches); 3: the persistent forward (1 launch per layer: the R slices
    once, then per step the traffic of `v3_traffic` + one grid barrier) when v3_slices.v3_co_residency says it can
    run, else v2's forward (row["runs"] says which); its backward likewise (`v3_backward_traffic`, one launch:
    the columns of R once, then T + 1 steps of traffic + a grid barrier each; row["backward_runs"]).
    """
    from ..kernels import step_v2, v3_slices  # lazy: the kernels import numba.cuda
    gpu = GPUS[gpu_name]
    out = []
    G, s = 4, 4
    for H, B, T in shapes:
        I = H
        gemm_f, gemm_b = _gemm_ms(gpu, T, B, H, I, G)
        row = dict(H=H, B=B, T=T, gpu=gpu_name, version=version, runs=version, R_bytes=G * H * H * s, note="")
        if version == 1:
            tr = v1_step_traffic(H, I, B, measured=measured)
            grid_f = -(-H // V1_BLOCK) * B
            f_us, f_bound = step_time(gpu, tr["forward_step"], grid_f)
            rb_us, rb_bound = step_time(gpu, tr["recurrent_backward"], grid_f)
            bs_us, _ = step_time(gpu, tr["backward_step"], grid_f)
            f_us += gpu.launch_us
            b_us = rb_us + bs_us + 2 * gpu.launch_us
            fwd_ms = (T * f_us) / 1e3 + gemm_f
            bwd_ms = (T * b_us) / 1e3 + gemm_b
            row.update(R_bytes_per_step_forward=tr["forward_step"]["R_l2"], backward_bound=rb_bound)
        else:
            t2 = step_v2.tiles("float32", simulator=False, H=H, B=B, D=1, sms=gpu.sms)   # as the driver on this GPU
            tr = v2_step_traffic(H, I, B, measured=measured_v2, tiles=t2)
            f2, b2 = tr["forward_step_v2"], tr["backward_step_v2"]
            f_us, f_bound = step_time(gpu, f2, f2["blocks"])
            b_us, b_bound = step_time(gpu, b2, b2["blocks"])
            f_us += gpu.launch_us
            b_us += gpu.launch_us
            fwd_ms = T * f_us / 1e3 + gemm_f
            bwd_ms = (T + 1) * b_us / 1e3 + gemm_b
            row.update(R_bytes_per_step_forward=f2["R_l2"], backward_bound=b_bound, runs=2, v2_TJ=t2.TJ)
            if version == 3:
                sl, n, limit, why = v3_slices.v3_co_residency(gpu, H, H, G, B=B)
                row.update(note=why, v3_blocks=n, v3_limit=limit)
                if sl is not None:
                    tr3 = v3_traffic(H, I, B, sl, G, s)
                    load_us, _ = step_time(gpu, tr3["slice"], n)
                    f_us, f_bound = step_time(gpu, tr3["step"], n)
                    f_us += gpu.grid_sync_us
                    fwd_ms = (gpu.launch_us + load_us + T * f_us) / 1e3 + gemm_f
                    row.update(runs=3, R_bytes_per_step_forward=tr3["slice"]["l2"] / T, slice_TJ=sl.TJ,
                               v3_threads=sl.threads,
                               v3_bank_conflict=tr3["step"]["h_conflict"])
                bsl, bn, _, bwhy = v3_slices.v3_co_residency(gpu, H, H, G, B=B, phase="backward")
                row.update(backward_note=bwhy)
                if bsl is not None:
                    tb3 = v3_backward_traffic(H, I, B, bsl, G, s)
                    load_us, _ = step_time(gpu, tb3["slice"], bn)
                    b_us, b_bound = step_time(gpu, tb3["step"], bn)
                    b_us += gpu.grid_sync_us
                    bwd_ms = (gpu.launch_us + load_us + (T + 1) * b_us) / 1e3 + gemm_b
                    row.update(backward_runs=3, v3_backward_threads=bsl.threads)
        row.setdefault("backward_runs", min(version, 2))
        row.update(forward_step_us=f_us, forward_bound=f_bound, backward_step_us=b_us, forward_ms=fwd_ms,
                   forward_backward_ms=fwd_ms + bwd_ms)
        row.update({f"published_{k}_ms": v for k, v in PUBLISHED.get((H, B, T), {}).items()})
        out.append(row)
    return out


#: the GPU targets for v3's predicted forward time (ratio to cuDNN's published time, or to v3's own at ...)
TARGETS = {(768, 16, 1024): "within 3x of cuDNN's 2.01 ms and below haste's 18.41 ms",
           (256, 4, 1000): "within 1.5x (of cuDNN)"}


def format_deepbench_model(gpu_name: str = "H100 SXM", shapes=DEEPBENCH, measured=None, measured_v2=None) -> str:
    """The table of the profiler's MODEL of the v1, v2 and v3 step kernels at `shapes`, labelled as such
    (profiler.model_report adds freshly measured per-request figures), and the GPU targets' comparison points."""
    gpu = GPUS[gpu_name]
    rows = {v: deepbench_model(gpu_name, shapes, measured, v, measured_v2) for v in (1, 2, 3)}
    title = (f"the profiler's MODEL of the step kernels v1, v2, v3 on {gpu_name} (not a measurement: roofline "
             f"of traffic formulas checked against the simulator's per-request figures, + {gpu.launch_us} us per "
             f"launch and {gpu.grid_sync_us} us per v3 grid barrier, both approximate; L1 includes shared "
             f"memory; fp32 LSTM, one layer, H = I; input GEMMs at 50% of fp32 peak)")
    header = (f"{'H':>5} {'B':>4} {'T':>5} {'ver':>6}  {'R/step fwd':>11} {'fwd step us':>11} {'bound':>5} "
              f"{'bwd step us':>11} {'fwd ms':>9} {'fwd+bwd ms':>10}  notes")
    lines = [title, header]
    for i, (H, B, T) in enumerate(shapes):
        for v in (1, 2, 3):
            r = rows[v][i]
            ver = f"v{v}" if r["runs"] == v else f"v{v}>{r['runs']}"
            if r["backward_runs"] != r["runs"]:
                ver += f"/{r['backward_runs']}"
            note = r["note"]
            if v == 3 and r["runs"] == 3:
                conflict = r["v3_bank_conflict"]
                note = (f"TJ={r['slice_TJ']}, {r['v3_blocks']} blocks of {r['v3_threads']} threads, h tile "
                        + (f"{conflict}-way bank conflict" if conflict > 1 else "conflict-free"))
            elif v == 2 and r.get("v2_TJ") not in (None, 32):
                note = f"tiles of {r['v2_TJ']} units (step_v2.NARROW_TILES: 32 would leave SMs idle)"
            lines.append(f"{H:>5} {B:>4} {T:>5} {ver:>6}  {r['R_bytes_per_step_forward'] / 1e6:>8.2f} MB "
                         f"{r['forward_step_us']:>11.2f} {r['forward_bound']:>5} {r['backward_step_us']:>11.2f} "
                         f"{r['forward_ms']:>9.2f} {r['forward_backward_ms']:>10.2f}  {note}")
    lines.append("(v3>2: v3 cannot run there, v2 does; v3/2: v3's forward runs, its backward cannot, v2's does; "
                 "R/step of v3 = |R| / T: the slices are loaded once per layer)")
    lines += comparison_lines(rows[3], shapes)
    return "\n".join(lines)


def comparison_lines(v3_rows, shapes) -> list[str]:
    """The GPU targets' comparison points for the model's v3 forward, each stated as met or NOT met."""
    out = []
    by_shape = {(r["H"], r["B"], r["T"]): r for r in v3_rows}
    big = by_shape.get((768, 16, 1024))
    if big is not None:
        pub = PUBLISHED[(768, 16, 1024)]
        ratio = big["forward_ms"] / pub["cudnn"]
        ok = ratio <= 3 and big["forward_ms"] < pub["haste"]
        out.append(f"H=I=768 B=16 T=1024: model v{big['runs']} forward {big['forward_ms']:.2f} ms = {ratio:.1f}x "
                   f"cuDNN's published {pub['cudnn']} ms, haste's {pub['haste']} ms; the target (within 3x "
                   f"of cuDNN and below haste): {'met' if ok else 'NOT met'} by the model")
        if big["runs"] == 3:
            why = {"L1": "the shared-memory pipe (G + 1 vector loads per 4G FMAs, RB = 1 batch row a thread)",
                   "L2": "L2 traffic: every block stages all B rows of h each step",
                   "FP32": "the FMA pipe of the SMs that have blocks"}.get(big["forward_bound"], big["forward_bound"])
            out.append(f"  (what bounds it in the model: {why}, and one grid barrier per step)")
    small = by_shape.get((256, 4, 1000))
    if small is not None:
        lo = CUDNN_H100_FASTEST[(256, 4, 1000)]
        ok = small["forward_ms"] <= 1.5 * lo
        out.append(f"H=I=256 B=4 T=1000: model v{small['runs']} forward {small['forward_ms']:.2f} ms = "
                   f"{small['forward_ms'] / lo:.2f}x cuDNN's fastest MEASURED forward on an H100 ({lo:.2f} ms; "
                   f"no published time at this shape); the target (within 1.5x of cuDNN): "
                   f"{'met' if ok else 'NOT met'} by the model")
    if out:
        out.append("  (what the kernels measured on an H100, beside cuDNN: bench/results/gpu_h100.md)")
    return out

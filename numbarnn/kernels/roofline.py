"""A roofline MODEL of kernel time from the profiler's traffic figures and published GPU numbers.

Nothing here is a measurement of time: no GPU is involved.  For a group of launches

    t = launches x launch_gap + max(DRAM bytes / HBM bandwidth,
                                    L2 bytes / L2 bandwidth,
                                    L1 bytes / L1 bandwidth,
                                    FLOPs / fp32 peak)

with the byte counts from `numbarnn.kernels.profiler` (dram_bytes: distinct sectors of a launch; l2_bytes:
each block's distinct sectors; l1_bytes: every request's sectors) and FLOPs from the driver's launch plan.
It assumes perfect overlap and full occupancy, and ignores latency (one step of a small RNN is latency-bound
on a real GPU), so it is optimistic for small shapes; it is a ranking and an order of magnitude, not a timer.

`deepbench_model(...)` extrapolates the v1 step kernels to the DeepBench shapes with traffic formulas whose
per-request figures (sectors per request of R, broadcast reads) are the ones the profiler measures on the
simulator at a small shape (tests/test_profiler.py checks formula == measurement there).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    hbm: float           # DRAM bandwidth, bytes/s
    l2: float            # L2 bandwidth, bytes/s (approximate: NVIDIA does not publish it)
    l1: float            # aggregate L1/load-store bandwidth, bytes/s: SMs x 128 B/clk x boost clock
    fp32: float          # fp32 FLOP/s (non-tensor)
    sms: int
    launch_us: float     # device-side gap per dependent kernel launch, microseconds (approximate)


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): HBM3 3.35 TB/s, FP32 67 TFLOPS; H100 whitepaper: 132 SMs,
    # 50 MB L2; L1: 132 x 128 B/clk x 1.98 GHz.  L2 ~7 TB/s: third-party microbenchmarks (Chips and Cheese,
    # "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023, measured the PCIe part; scaled), approximate.
    "H100 SXM": GPU("H100 SXM", hbm=3.35e12, l2=7.0e12, l1=132 * 128 * 1.98e9, fp32=67e12, sms=132,
                    launch_us=2.5),
    # NVIDIA A100 datasheet (SXM4 80GB): HBM2e 2.039 TB/s, FP32 19.5 TFLOPS; A100 whitepaper: 108 SMs, 40 MB L2,
    # "2.3x the L2 read bandwidth of V100" (V100 L2 ~2.2 TB/s measured by Jia et al., "Dissecting the NVIDIA
    # Volta GPU Architecture via Microbenchmarking", 2018) -> ~5 TB/s, approximate; L1: 108 x 128 x 1.41 GHz.
    "A100 SXM": GPU("A100 SXM", hbm=2.039e12, l2=5.0e12, l1=108 * 128 * 1.41e9, fp32=19.5e12, sms=108,
                    launch_us=2.5),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): GDDR6X 1008 GB/s, FP32 82.6 TFLOPS, 128 SMs,
    # 72 MB L2, boost 2.52 GHz; L2 ~5 TB/s approximate (third-party microbenchmarks).
    "RTX 4090": GPU("RTX 4090", hbm=1.008e12, l2=5.0e12, l1=128 * 128 * 2.52e9, fp32=82.6e12, sms=128,
                    launch_us=2.5),
}
# launch_us: back-to-back dependent launches of tiny kernels cost a few microseconds each on the device
# (NVIDIA technical blog "Getting Started with CUDA Graphs", 2019: ~3 us per short kernel without graphs).
# A Python host adds its own time per launch (numba: argument typing and packing); that is not modelled here.

#: published reference times (ms, fp32 LSTM training forward pass per DeepBench-style shape) quoted by issue 8
PUBLISHED = {(768, 16, 1024): dict(cudnn=2.01, haste=18.41)}

#: the DeepBench-style LSTM shapes of issue 8: (H = I, B, T)
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


def deepbench_model(gpu_name: str = "H100 SXM", shapes=DEEPBENCH, measured=None) -> list[dict]:
    """Predicted v1 LSTM times (fp32, one layer) at each (H = I, B, T): per step and for the whole call,
    forward (the T step launches + the input GEMM) and forward + backward.  A MODEL."""
    gpu = GPUS[gpu_name]
    out = []
    for H, B, T in shapes:
        I = H
        tr = v1_step_traffic(H, I, B, measured=measured)

        def t(k, tr=tr):
            sec, which = bound_time(gpu, tr[k]["dram"], tr[k]["l2"], tr[k]["l1"], tr[k]["flops"])
            return sec * 1e6 + gpu.launch_us, which

        f_us, f_bound = t("forward_step")
        rb_us, rb_bound = t("recurrent_backward")
        bs_us, _ = t("backward_step")
        G, s = 4, 4
        # GEMMs outside the loop at fp32 peak (v3 reaches at most ~50% of it: issue 8), compulsory bytes
        gemm_fwd = 2 * T * B * G * H * I / (0.5 * gpu.fp32) * 1e6
        gemm_bwd = 3 * 2 * T * B * G * H * I / (0.5 * gpu.fp32) * 1e6
        fwd_ms = (T * f_us + gemm_fwd) / 1e3
        bwd_ms = (T * (rb_us + bs_us) + gemm_bwd) / 1e3
        row = dict(H=H, B=B, T=T, gpu=gpu_name, forward_step_us=f_us, forward_bound=f_bound,
                   backward_step_us=rb_us + bs_us, backward_bound=rb_bound, forward_ms=fwd_ms,
                   forward_backward_ms=fwd_ms + bwd_ms,
                   R_bytes_per_step_forward=tr["forward_step"]["R_l2"],
                   R_bytes=G * H * H * s)
        row.update({f"published_{k}_ms": v for k, v in PUBLISHED.get((H, B, T), {}).items()})
        out.append(row)
    return out


def format_deepbench_model(gpu_name: str = "H100 SXM", shapes=DEEPBENCH, measured=None) -> str:
    """The table of the profiler's MODEL of v1 at `shapes`, labelled as such (profiler.model_report adds
    freshly measured per-request figures)."""
    rows = deepbench_model(gpu_name, shapes, measured)
    title = (f"the profiler's MODEL of the v1 kernels on {gpu_name} (not a measurement: roofline of traffic "
             f"formulas fitted to the simulator's per-request figures, + {GPUS[gpu_name].launch_us} us per launch; "
             f"fp32 LSTM, one layer, H = I)")
    header = (f"{'H':>5} {'B':>4} {'T':>5}  {'R/step fwd':>11} {'fwd step us':>11} {'bound':>5} "
              f"{'bwd step us':>11} {'fwd ms':>9} {'fwd+bwd ms':>10}  published fwd (cuDNN / haste)")
    lines = [title, header]
    for r in rows:
        pub = ""
        if "published_cudnn_ms" in r:
            pub = f"{r['published_cudnn_ms']} / {r['published_haste_ms']} ms"
        lines.append(f"{r['H']:>5} {r['B']:>4} {r['T']:>5}  {r['R_bytes_per_step_forward'] / 1e6:>8.1f} MB "
                     f"{r['forward_step_us']:>11.1f} {r['forward_bound']:>5} {r['backward_step_us']:>11.1f} "
                     f"{r['forward_ms']:>9.2f} {r['forward_backward_ms']:>10.2f}  {pub}")
    return "\n".join(lines)

"""v3's slices, without kernels: what one block of the persistent kernels holds (`Slice`), the slice a layer gets
(`plan`), wider blocks for a batch (`widen`, `widths`), and the arithmetic of rounds and co-residency that
`step_v3.choose`, the compile report and the roofline model share (no device needed).

A slice is TJ hidden units x all G gates of one direction: its rows of R (forward) or columns (backward) in
shared memory, padded to whole chunks of KC columns; the batch goes through it TB = RG * RB rows at a time.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..util import cdiv
from . import target
from .common import acc_dtype
from .gpus import ARCH, GPU, SM_LIMITS_EXTRA, resident_blocks
from .staging import pitch

class Slice(NamedTuple):
    """A v3 block: TJ units x all gates, rows TB = RG*RB at a time, h staged KC columns at a time, R slice
    capacity KMAX columns (>= P).  With a projection also TQ projected outputs (<= TJ: P <= H) and HMAX (>= H)
    columns for the W_proj rows (forward) and R's columns (backward); 0 without.  PF: whether the products
    prefetch (`prefetches`)."""

    TJ: int
    RG: int
    RB: int
    KC: int
    KMAX: int
    TQ: int = 0
    HMAX: int = 0
    PF: bool = True     # fetch the next chunk into registers during this chunk's products (`prefetches`)

    @property
    def TB(self) -> int:
        return self.RG * self.RB

    @property
    def threads(self) -> int:
        return self.TJ * self.RG


def prefetches(dtype, sl: Slice) -> bool:
    """Whether a slice's products fetch the next chunk during this one's products: a thread's staged values
    (ceil(TB / RS) rows) and their rows' time indexes stay live in registers meanwhile, so only where they are
    few (at most 16 words: float64 at TJ = 1 stages 32 rows a thread, and its backward spilled 180 bytes on
    sm_80 with them); else each chunk is staged just before it is stored, as in v2."""
    RS = sl.threads // sl.KC
    return cdiv(sl.TB, RS) * max(1, acc_dtype(dtype).itemsize // 4) <= 16

SIM_SLICE = Slice(TJ=3, RG=2, RB=2, KC=2, KMAX=6)
SMEM_BUDGET = 40 * 1024          # bytes of static shared memory for the R slice (the limit is 48 KiB)
THREADS = 64                     # the block `plan` sizes the slices for (TJ units x THREADS // TJ row groups)
#: the blocks `choose` considers (multiples of the warp and of KC = 32): more row groups for the same slice
WIDTHS = (64, 96, 128, 192, 256)


def shared_dims(G: int, sl: Slice, dtype) -> tuple:
    """(GJ, KP, HMP, HP, RP), in words of the compute dtype: the R slice's G*TJ rows and their pitch (KMAX padded:
    `staging.pitch`, rows 16-byte aligned), the pitch of the rows of HMAX (W_proj's rows, R's columns: with a
    projection), the h tile's (`h_pitch`) and red's (`red_pitch`).  What the kernels declare and `slice_bytes`
    counts."""
    return G * sl.TJ, pitch(sl.KMAX, dtype), pitch(sl.HMAX, dtype), h_pitch(sl, dtype), red_pitch(G, sl)


def slice_bytes(G: int, sl: Slice, dtype) -> int:
    """Shared memory of a block: the R slice (padded rows), the h tile and the splits' partial sums (TB x G*TJ),
    in the compute dtype; with a projection the larger phase pair: forward R rows + W_proj rows, backward
    W_proj columns + R columns."""
    GJ, KP, HMP, HP, RP = shared_dims(G, sl, dtype)
    words = GJ * KP
    if sl.TQ:
        words = max(words + sl.TQ * HMP, sl.TJ * KP + G * sl.TQ * HMP)
    return (words + sl.TB * HP + sl.TB * RP) * acc_dtype(dtype).itemsize   # + `red`: the splits' partial sums


def projected_per_block(H: int, P: int, TJ: int) -> int:
    """TQ: the projected outputs a block owns when ceil(H / TJ) blocks share P (<= TJ since P <= H)."""
    return max(1, cdiv(P, cdiv(H, TJ)))


def h_pitch(sl: Slice, dtype) -> int:
    """Words between rows of the h tile: `pitch(KC)`, KC + 4 in float32."""
    return pitch(sl.KC, dtype)


def red_pitch(G: int, sl: Slice) -> int:
    """Words between rows of `red`, the splits' partial sums (a thread's G gates x TJ units per row): G*TJ + 1,
    padded by one word like the h tile, so the 32 / TJ row groups of a warp spread over the banks (G*TJ words
    apart, 8 at TJ = 2, they would fall on 4 banks; the profiler's model counts the wavefronts,
    roofline.v3_product_wavefronts)."""
    return G * sl.TJ + 1


def plan(G: int, H: int, P: int, dtype, simulator: bool | None = None, has_proj: bool = False) -> Slice | None:
    """The slice for a layer: the largest TJ (16, 8, 4, 2, 1) whose slices fit SMEM_BUDGET, or None.
    In the simulator: SIM_SLICE when P (and with a projection H) fits its KMAX."""
    if target.simulator(simulator):
        if P > SIM_SLICE.KMAX or (has_proj and H > SIM_SLICE.KMAX):
            return None
        return SIM_SLICE._replace(TQ=projected_per_block(H, P, SIM_SLICE.TJ),
                                  HMAX=SIM_SLICE.KMAX) if has_proj else SIM_SLICE
    kmax = cdiv(P, 32) * 32
    for TJ in (16, 8, 4, 2, 1):
        sl = Slice(TJ=TJ, RG=THREADS // TJ, RB=1, KC=32, KMAX=kmax)
        if has_proj:
            sl = sl._replace(TQ=projected_per_block(H, P, TJ), HMAX=cdiv(H, 32) * 32)
        if slice_bytes(G, sl, dtype) <= SMEM_BUDGET and TJ <= max(H, 1):
            return sl._replace(PF=prefetches(dtype, sl))
    return None


def blocks_needed(H: int, D: int, sl: Slice) -> int:
    return cdiv(H, sl.TJ) * D


def widen(G: int, sl: Slice, dtype, threads: int) -> Slice | None:
    """`sl` run by a block of `threads` threads: the same TJ units and R slice (so the same blocks, and a
    thread's work the same: about the same registers), RG = threads // TJ row groups, a row tile of TB = RG
    rows.  A batch smaller than TB splits its chunks of K over the row groups it leaves idle (`make_split_k`),
    a larger one needs fewer row tiles: either way a thread runs fewer rounds of products per step, and an SM
    holds more warps to hide their latency (the H100 measured v3 latency bound, at about one warp per
    scheduler: bench/results/gpu_h100.md).  None where the larger h tile and `red` would not fit
    SMEM_BUDGET, or where threads is not a multiple of TJ and KC."""
    if threads % sl.TJ or threads % sl.KC or sl.RB != 1:
        return None
    wide = sl._replace(RG=threads // sl.TJ)
    if slice_bytes(G, wide, dtype) > SMEM_BUDGET:
        return None
    return wide._replace(PF=prefetches(dtype, wide))


def widths(G: int, sl: Slice, B: int, dtype) -> list:
    """The slices `choose` tries for a batch of B rows, best first: the widths of WIDTHS `widen` allows that cut
    the rounds of products a thread runs per step (`v3_rounds`), fewest rounds first, then fewest
    threads (less to sum through `red`, fewer warps at each barrier); `sl` itself, the fallback, last."""
    base = v3_rounds(B, sl)
    wide = [w for w in (widen(G, sl, dtype, t) for t in WIDTHS if t != sl.threads)
            if w is not None and v3_rounds(B, w) < base]
    return sorted(wide, key=lambda w: (v3_rounds(B, w), w.threads)) + [sl]



def gpu_slices(G: int, dtype) -> dict:
    """{H: Slice} of the report's shapes (H = P = 256, 512, 1024)."""
    return {H: plan(G, H, H, dtype, simulator=False) for H in (256, 512, 1024)}


# ---------------------------------------------------------------------------------------------------
# without a device: the rounds of products a block runs (what `widths` ranks), and the blocks a GPU of
# gpus.GPUS holds at once (the estimate `choose` makes before it compiles a wider block; the `_wide` kernel
# specs; the compile report and the roofline model)
# ---------------------------------------------------------------------------------------------------

def v3_splits(B: int, sl) -> list[tuple[int, int]]:
    """(RN, KS) of each row tile of a v3 block (`make_split_k`): a tile of fewer rows than TB splits its
    chunks of K over KS = TB // RN splits of RN rows (the rows rounded up to a multiple of lcm(RH, RB)); one split
    without prefetching."""
    RS = sl.threads // sl.KC
    RH = cdiv(sl.TB, RS)
    L = RH * sl.RB // math.gcd(RH, sl.RB)
    out = []
    for b0 in range(0, B, sl.TB):
        RN = cdiv(min(sl.TB, B - b0), L) * L if sl.PF else sl.TB
        out.append((RN, max(1, sl.TB // RN)))
    return out


def v3_rounds(B: int, sl) -> int:
    """Rounds of staged products one thread of a v3 block runs per gate and step for a batch of B rows: over
    its row tiles, the KMAX / KC chunks of K shared by each tile's KS splits (`v3_splits`)."""
    nch = sl.KMAX // sl.KC
    return sum(cdiv(nch, KS) for _, KS in v3_splits(B, sl))


#: registers per thread of lstm_forward_persistent_v3 (float32, sm_90) as ptxas allocates them:
#: `numbarnn kernels --cc 90 --only persistent_v3` (compiled at the H = 512 slice, TJ = 4).  The co-residency
#: estimate below (`v3_registers`) uses it for every GPU and slice of TJ > 2; the TJ = 2 slices take
#: V3_REGISTERS_TJ2.  The driver on a GPU asks the device with the compiled kernel
#: (`device_cooperative_limit`).
#: 138 before the k loop's vector loads (4 words of every gate's row and of h live at once), 168 with them.
V3_REGISTERS = 168
#: the same for lstm_backward_persistent_v3 (`numbarnn kernels --cc 90 --only backward_persistent_v3`; 163
#: before the vector loads)
V3_BACKWARD_REGISTERS = 168
#: the TJ = 2 slices (H = 768, 1024: 16 staged rows a thread), sm_90, forward and backward, at 64 and at 128
#: threads alike (a thread's work does not depend on the block's width, `widen`; ptxas gave the forward
#: 168 at 96 threads); sm_80 takes 222 / 225 there.  Measured with the compile report's link_info_log of the
#: H = 768 slice's kernels.
V3_REGISTERS_TJ2 = {"forward": 172, "backward": 168}


def v3_registers(TJ: int, phase: str = "forward") -> int:
    """The registers a thread of the persistent v3 kernel of `phase` is estimated to take at a slice of TJ
    units (sm_90 figures, the estimate for every GPU: the device decides on a GPU)."""
    if TJ <= 2:
        return V3_REGISTERS_TJ2[phase]
    return V3_REGISTERS if phase == "forward" else V3_BACKWARD_REGISTERS


def v3_limit(cc, sms: int, G: int, sl, dtype="float32", registers: int = V3_REGISTERS) -> int | None:
    """Blocks of a v3 slice `sl` co-resident on a GPU of compute capability cc with `sms` SMs (SMs x resident
    blocks per SM, from the per-SM limits of gpus.ARCH / gpus.SM_LIMITS_EXTRA, the slice's shared memory and
    `registers` a thread); None for a compute capability neither table has."""
    arch = ARCH.get(tuple(cc)) or SM_LIMITS_EXTRA.get(tuple(cc))
    if arch is None:
        return None
    shared = slice_bytes(G, sl, dtype)
    if tuple(cc) >= (9, 0):
        shared += arch["smem_reserved"]        # gpus.resident_blocks takes the linker's count (reserve in)
    return resident_blocks(tuple(cc), sl.threads, registers, shared, arch=arch) * sms


def v3_co_residency(gpu: GPU, H: int, P: int, G: int = 4, D: int = 1, dtype="float32",
                    registers: int | None = None, B: int | None = None, phase: str = "forward") -> tuple:
    """(Slice or None, blocks needed, co-resident limit, why) of the persistent v3 kernel of `phase` on `gpu`,
    as `choose` decides on a device: the slice from `plan` (the largest TJ whose R slice fits), all
    `blocks_needed` blocks co-resident, and given the batch B the first of `widths` (wider blocks)
    that is.  choose asks the device (max_cooperative_grid_blocks); here the limit is `v3_limit`, with
    `registers` a thread (default `v3_registers`)."""
    base = plan(G, H, P, dtype, simulator=False)
    if base is None:
        return None, 0, 0, f"the R slice for P={P} does not fit {SMEM_BUDGET} bytes of shared memory"
    n = blocks_needed(H, D, base)
    fallback = None
    for sl in ([base] if B is None else widths(G, base, B, dtype)):
        regs = v3_registers(sl.TJ, phase) if registers is None else registers
        limit = v3_limit(gpu.cc, gpu.sms, G, sl, dtype, regs)
        per_sm = limit // gpu.sms
        if n <= limit:
            return sl, n, limit, (f"v3: {n} blocks (TJ={sl.TJ}, {sl.threads} threads) co-resident, limit "
                                  f"{per_sm} per SM x {gpu.sms} = {limit}")
        fallback = (f"v3 not co-resident: {n} blocks of {sl.threads} threads needed, {per_sm} per SM "
                    f"x {gpu.sms} SMs = {limit}: v2 runs")
    return None, n, limit, fallback

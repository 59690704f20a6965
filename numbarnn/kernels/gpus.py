"""What the kernels' plans and the analysis tools know of a GPU without asking one.

The reference GPUs' published figures (`GPUS`), the per-SM limits of compute capabilities (`ARCH`,
`SM_LIMITS_EXTRA`) with the occupancy arithmetic on them (`resident_blocks`, `occupancy`), and the memory
system's granularities (`SECTOR`, `WARP`, `BANKS`, ...).  One table for both sides: step_v3 estimates which of
its blocks can be co-resident from these limits, and numbarnn.analysis (the compile report, the roofline model,
the profiler) states and prices the same.  Imports neither numba nor the rest of numbarnn, so a command can read
it before it chooses numba's CUDA simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..util import cdiv

SECTOR = 32              # bytes per sector (L1/L2 granularity of NVIDIA GPUs since Maxwell)
WARP = 32
BANKS, BANK_WIDTH = 32, 4   # shared-memory banks of 4-byte words
WAVEFRONT = 128          # bytes the L1/shared pipe moves per clock per SM
VECTOR_BYTES = 16        # an LDS.128: the widest shared load


#: one grid-wide barrier (`cuda.cg.this_grid().sync()`) of a cooperative launch whose blocks fill the GPU,
#: microseconds.  APPROXIMATE: microbenchmarks of cooperative-groups grid sync on P100/V100 (H. Zhang, L. Zhang,
#: M. Wahib, S. Matsuoka, "A Study of Single and Multi-device Synchronization Methods in Nvidia GPUs", IPDPS
#: 2020, arXiv:2004.05371) put it in the low microseconds, growing with the blocks per SM; no H100 figure is
#: published that we know of.  2 us is that order of magnitude, not a measurement.
GRID_SYNC_US = 2.0


@dataclass(frozen=True)
class GPU:
    name: str
    hbm: float           # DRAM bandwidth, bytes/s
    l2: float            # L2 bandwidth, bytes/s (approximate: NVIDIA does not publish it)
    l1: float            # aggregate L1/load-store bandwidth, bytes/s: SMs x 128 B/clk x boost clock
    fp32: float          # fp32 FLOP/s (non-tensor)
    sms: int
    launch_us: float     # device-side gap per dependent kernel launch, microseconds (approximate)
    cc: tuple = (9, 0)   # compute capability: per-SM limits for co-residency (ARCH, SM_LIMITS_EXTRA)
    grid_sync_us: float = GRID_SYNC_US   # one grid-wide barrier of a cooperative launch (approximate)


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): HBM3 3.35 TB/s, FP32 67 TFLOPS; H100 whitepaper: 132 SMs,
    # 50 MB L2; L1: 132 x 128 B/clk x 1.98 GHz.  L2 ~7 TB/s: third-party microbenchmarks (Chips and Cheese,
    # "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023, measured the PCIe part; scaled), approximate.
    "H100 SXM": GPU("H100 SXM", hbm=3.35e12, l2=7.0e12, l1=132 * 128 * 1.98e9, fp32=67e12, sms=132,
                    launch_us=2.5, cc=(9, 0)),
    # NVIDIA A100 datasheet (SXM4 80GB): HBM2e 2.039 TB/s, FP32 19.5 TFLOPS; A100 whitepaper: 108 SMs, 40 MB L2,
    # "2.3x the L2 read bandwidth of V100" (V100 L2 ~2.2 TB/s measured by Jia et al., "Dissecting the NVIDIA
    # Volta GPU Architecture via Microbenchmarking", 2018) -> ~5 TB/s, approximate; L1: 108 x 128 x 1.41 GHz.
    "A100 SXM": GPU("A100 SXM", hbm=2.039e12, l2=5.0e12, l1=108 * 128 * 1.41e9, fp32=19.5e12, sms=108,
                    launch_us=2.5, cc=(8, 0)),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): GDDR6X 1008 GB/s, FP32 82.6 TFLOPS, 128 SMs,
    # 72 MB L2, boost 2.52 GHz; L2 ~5 TB/s approximate (third-party microbenchmarks).
    "RTX 4090": GPU("RTX 4090", hbm=1.008e12, l2=5.0e12, l1=128 * 128 * 2.52e9, fp32=82.6e12, sms=128,
                    launch_us=2.5, cc=(8, 9)),
}
# launch_us: back-to-back dependent launches of tiny kernels cost a few microseconds each on the device
# (NVIDIA technical blog "Getting Started with CUDA Graphs", 2019: ~3 us per short kernel without graphs).
# A Python host adds its own time per launch (numba: argument typing and packing); that is not modelled here.


#: per-SM limits (CUDA programming guide, "Compute capabilities", and the occupancy calculator) of the compute
#: capabilities the compile report compiles for
ARCH = {
    (8, 0): dict(max_threads=2048, max_blocks=32, max_warps=64, regs=65536, max_regs_per_thread=255,
                 max_regs_per_block=65536, reg_unit=256, smem=164 * 1024, smem_reserved=1024, smem_unit=128,
                 max_smem_per_block=163 * 1024),
    (9, 0): dict(max_threads=2048, max_blocks=32, max_warps=64, regs=65536, max_regs_per_thread=255,
                 max_regs_per_block=65536, reg_unit=256, smem=228 * 1024, smem_reserved=1024, smem_unit=128,
                 max_smem_per_block=227 * 1024),
}

#: per-SM limits of compute capabilities that ARCH does not list (CUDA C++ programming guide, "Compute
#: capabilities" table: sm_89 has 1536 threads / 48 warps / 24 blocks per SM, 64K registers, 100 KB shared
#: memory per SM, 99 KB per block)
SM_LIMITS_EXTRA = {
    (8, 9): dict(max_threads=1536, max_blocks=24, max_warps=48, regs=65536, max_regs_per_thread=255,
                 max_regs_per_block=65536, reg_unit=256, smem=100 * 1024, smem_reserved=1024, smem_unit=128,
                 max_smem_per_block=99 * 1024),
}


def _round_up(x: int, unit: int) -> int:
    return cdiv(x, unit) * unit


def resident_blocks(cc: tuple, block: int, registers: int, shared: int, arch: dict | None = None) -> int:
    """Blocks of one kernel that fit on an SM at once (0: cannot launch): the least of the warp, block,
    register and shared-memory limits of `arch` (default ARCH[cc]).  shared: static smem as the linker prints
    it (on sm_90 that includes the 1 KiB reserve whenever the kernel has shared memory)."""
    arch = ARCH[tuple(cc)] if arch is None else arch
    warps_per_block = math.ceil(block / 32)
    if block > 1024 or registers > arch["max_regs_per_thread"] or shared > arch["max_smem_per_block"]:
        return 0
    by_warps = arch["max_warps"] // warps_per_block
    regs_per_warp = _round_up(max(registers, 1) * 32, arch["reg_unit"])
    if regs_per_warp * warps_per_block > arch["max_regs_per_block"]:
        return 0
    by_regs = (arch["regs"] // regs_per_warp) // warps_per_block
    # 1 KiB per block is reserved for the system on sm_80 and sm_90; for sm_90 the linker's smem count
    # already includes it whenever the kernel has static shared memory (4096 bytes of tiles read 5120).
    reserved = 0 if (tuple(cc) >= (9, 0) and shared > 0) else arch["smem_reserved"]
    smem_per_block = _round_up(shared, arch["smem_unit"]) + reserved
    by_smem = arch["smem"] // smem_per_block
    return min(arch["max_blocks"], by_warps, by_regs, by_smem)


def occupancy(cc: tuple, block: int, registers: int, shared: int) -> float:
    """Theoretical occupancy in [0, 1]: resident warps per SM / max warps per SM (0: cannot launch)."""
    arch = ARCH[tuple(cc)]
    return resident_blocks(cc, block, registers, shared) * math.ceil(block / 32) / arch["max_warps"]

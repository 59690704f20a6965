"""GEMM kernels, numbered side by side like llm.c's dev/cuda: C = alpha * op(A) @ op(B) + beta * C.

    op(X) = X or X^T (flags ``trans_a`` / ``trans_b``): a transposed operand is read through swapped
            indices (its strides), never copied.
    shapes: op(A) [M, K], op(B) [K, N], C [M, N]; batched: every array gets a leading batch
            dimension Z (directions, steps, ...) and batch z runs in grid dimension z.
    dtypes: float16 is stored as half and accumulated in float32; float32 and float64 accumulate in
            their own dtype (float64 stays float64 all the way).
    beta:   BLAS rule: beta == 0 means C is write-only (it is never read, so garbage or NaN in an
            uninitialised C does not leak into the result).

Versions (one line each at the top of its factory, the "what changed and why"):
    v1 naive                one thread per output element, a straight port of the sum.
    v2 shared-memory tiles  TILE x TILE threads stage TILE x TILE tiles of op(A) and op(B) in shared memory.
    v3 register blocking    each thread computes TM x TN outputs of a BM x BN block tile from shared
                            tiles.
    v4 double buffering     8 x 8 outputs per thread (v3: 4 x 4) in 128 x 128 block tiles, two shared
                            buffers per operand: the next k-tile's global loads go into registers before
                            this tile's FMAs and into the other buffer after them (numba has no async
                            copy), one barrier per k-tile; the version the rest of numbarnn uses
                            (``DEFAULT_VERSION``; ``version=3`` still selects v3).
    v4 split-K              for outputs of fewer block tiles than the GPU has SMs and a long K: blockIdx.z
                            takes a slice of K, each slice's partial tile goes to a workspace, and
                            ``split_k_sum`` adds the slices in a fixed order (``gemm(split_k=...)``,
                            automatic by ``split_k_for``; float32/float64).

Tile sizes (compile-time constants of the factories; ``GemmVersion.gpu_config`` / ``sim_config``):
    on a GPU   v1 16 x 16 threads; v2 TILE=16 (256 threads); v3 BM=BN=64, BK=8, TM=TN=4
               (16 x 16 = 256 threads, 16 outputs each, 4 KiB (float32) of shared memory);
               v4 BM=BN=128, BK=4, TM=TN=8 (16 x 16 = 256 threads, 64 outputs each, 2 x 2 padded
               buffers = 8.5 KiB (float32) of shared memory).
    simulator  v1 4 x 4 threads; v2 TILE=8 (64 threads); v3 BM=BN=8, BK=4, TM=TN=2 (16 threads);
               v4 BM=8, BN=4, BK=2, TM=4, TN=2 (4 threads; non-square so swapped indices fail): the
               simulator runs one Python thread per CUDA thread, and small tiles keep several blocks and
               several k-tiles in play even for the tiny shapes the tests use.
The same kernel source runs both ways; ``gemm(..., config=...)`` picks other tiles.

Layers: factory ``make_gemm_vN_pyfunc`` (plain Python function closing over the compile-time constants;
the kernel report compiles exactly that function), ``get_kernel`` (cached ``cuda.jit`` of it with an
explicit signature, compiled once per specialisation), launcher ``gemm`` (validates, computes the
grid, launches) and ``matmul`` (NumPy in, NumPy out).  op(X)[row, col] and the C update are tiny
device functions chosen per (trans, batched), ``common.device`` (NVVM inlines them; ``compile_ptx``
works without a GPU: ``common.device`` says how).

Resources (``python -m numbarnn.analysis.report --only gemm_``, sm_80, GPU tiles, no spills anywhere):
v1 ~32 registers, v2 32 registers + 2 KiB smem (float32), v3 68 registers + 4 KiB smem (float32 and
float16; 92 + 8 KiB for float64), i.e. 37.5 % (25 % for float64) theoretical occupancy at 256 threads.

v3 against v4 (GPU tiles, 256 threads; FMAs per load counted from the tile sizes; registers, shared
memory (sm_80) and occupancy from the report over nn/nt/tn/tt, batched or not, sm_80 and sm_90):

                              v3 (64x64x8, 4x4)        v4 (128x128x4, 8x8)
    FMAs per shared load      TM*TN/(TM+TN) = 2        4
    FMAs per global load      1/(1/BM + 1/BN) = 32     64
    barriers per k-tile       2                        1 (per thread: 1 per 256 FMAs, v3: 1 per 64)
    registers float32/16      60-70                    124-128 (sm_80), 118 (sm_90)
    registers float64         78-92                    188-214
    shared memory             4 KiB (8 KiB float64)    8.5 KiB (17 KiB float64)
    occupancy float32/16      38-50 %                  25 %
    occupancy float64         25-38 %                  12.5 %
    spills                    0                        0
v4 trades occupancy for instruction-level parallelism (64 independent FMAs per k per thread) and halves
both shared and global loads per FMA.  Global loads: numba has no float4 loads from Python, so wide
transactions come from consecutive threads reading consecutive addresses (the staging order walks each
operand's contiguous axis); with BK = 4 a k-contiguous operand gives a warp 16 bytes (float32) per row,
half a 32-byte sector, whose other half the next k-tile reads (BK = 8 kept whole sectors but cost 148
registers, one block per SM).

Why one file: the four versions side by side are the lesson (llm.c style); they share the
operand accessors, the launcher and the cache, which would otherwise be imported back and forth.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import config as numba_config
from numba import cuda, types

from numbarnn.util import cdiv
from numbarnn.validation import ArgumentTypeError, check_same_dtype, shape_of

from . import common, gpus, target
from .launch import launch

DTYPES = ("float16", "float32", "float64")

#: accumulation dtype per storage dtype: half is computed in float32
ACCUMULATE = {"float16": "float32", "float32": "float32", "float64": "float64"}

#: CUDA grid limits in y and z (x is 2**31 - 1)
_MAX_GRID_YZ = 65535


def _numpy_scalar(dtype: str):
    """np.float32 / np.float64: a cast that reads the same in a kernel and in the simulator."""
    return getattr(np, dtype)


def _numba_type(dtype: str):
    return getattr(types, dtype)


# --------------------------------------------------------------------------------------------------
# element access: op(X)[row, col] of batch z, chosen once per (trans, batched) at factory time
# --------------------------------------------------------------------------------------------------
@functools.cache
def _op_loader(trans: bool, batched: bool):
    """Device function ``at(x, z, row, col)`` = op(x)[row, col] of batch z (z ignored unless batched)."""
    if batched and trans:
        def at(x, z, row, col):  # x: [Z, cols, rows]
            return x[z, col, row]
    elif batched:
        def at(x, z, row, col):  # x: [Z, rows, cols]
            return x[z, row, col]
    elif trans:
        def at(x, z, row, col):  # x: [cols, rows]
            return x[col, row]
    else:
        def at(x, z, row, col):  # x: [rows, cols]
            return x[row, col]
    return common.device(at)


@functools.cache
def _c_updater(dtype: str, batched: bool):
    """Device function ``update(c, z, row, col, alpha, acc, beta)``: C = alpha * acc + beta * C.

    beta == 0 never reads C (BLAS rule).  C is read and the sum formed in the accumulation dtype, the
    store casts back to C's dtype.
    """
    ACC = _numpy_scalar(ACCUMULATE[dtype])
    if batched:
        def update(c, z, row, col, alpha, acc, beta):  # c: [Z, M, N]
            if beta == 0:
                c[z, row, col] = alpha * acc
            else:
                c[z, row, col] = alpha * acc + beta * ACC(c[z, row, col])
    else:
        def update(c, z, row, col, alpha, acc, beta):  # c: [M, N]
            if beta == 0:
                c[row, col] = alpha * acc
            else:
                c[row, col] = alpha * acc + beta * ACC(c[row, col])
    return common.device(update)


def kernel_signature(dtype: str, batched: bool, split: bool = False) -> tuple:
    """numba argument types of every GEMM kernel: (M, N, K, alpha, a, b, beta, c).

    Layout 'A' (any strides): transposed views and slices run through the same compiled kernel.
    split (v4 split-K, stage 1): a and b 2-D, c the partials [Z, M, N].
    """
    nd = 3 if batched else 2
    array = types.Array(_numba_type(dtype), nd, "A")
    c = types.Array(_numba_type(dtype), 3, "A") if split else array
    acc = _numba_type(ACCUMULATE[dtype])
    return (types.int64, types.int64, types.int64, acc, array, array, acc, c)


# --------------------------------------------------------------------------------------------------
# v1
# --------------------------------------------------------------------------------------------------
def make_gemm_v1_pyfunc(dtype: str, trans_a: bool, trans_b: bool, batched: bool, BX: int, BY: int):
    # v1 naive: one thread per C element, the sum over k straight from global memory (the reference point).
    ACC = _numpy_scalar(ACCUMULATE[dtype])
    op_a = _op_loader(trans_a, batched)
    op_b = _op_loader(trans_b, batched)
    update_c = _c_updater(dtype, batched)

    def gemm_v1(
        M,      # int: rows of op(A) and C
        N,      # int: columns of op(B) and C
        K,      # int: columns of op(A) = rows of op(B)
        alpha,  # scalar (accumulation dtype)
        a,      # [M, K] ([K, M] if trans_a), [Z, ...] if batched
        b,      # [K, N] ([N, K] if trans_b), [Z, ...] if batched
        beta,   # scalar (accumulation dtype)
        c,      # [M, N], [Z, M, N] if batched (read unless beta == 0, written)
    ):
        col = cuda.blockIdx.x * BX + cuda.threadIdx.x  # block: BX x BY threads
        row = cuda.blockIdx.y * BY + cuda.threadIdx.y
        z = cuda.blockIdx.z
        if row < M and col < N:
            acc = ACC(0)
            for k in range(K):  # acc = sum_k op(A)[row, k] * op(B)[k, col]
                acc += ACC(op_a(a, z, row, k)) * ACC(op_b(b, z, k, col))
            update_c(c, z, row, col, alpha, acc, beta)

    return gemm_v1


def launch_v1(M: int, N: int, Z: int, config: tuple) -> tuple:
    BX, BY = config
    return (math.ceil(N / BX), math.ceil(M / BY), Z), (BX, BY, 1)


# --------------------------------------------------------------------------------------------------
# v2
# --------------------------------------------------------------------------------------------------
def make_gemm_v2_pyfunc(dtype: str, trans_a: bool, trans_b: bool, batched: bool, TILE: int):
    # v2 shared-memory tiles: each op(A)/op(B) element is read from global memory once per block, not once per thread.
    ACC = _numpy_scalar(ACCUMULATE[dtype])
    ACC_T = _numba_type(ACCUMULATE[dtype])
    op_a = _op_loader(trans_a, batched)
    op_b = _op_loader(trans_b, batched)
    update_c = _c_updater(dtype, batched)
    # Coalescing: threadIdx.x (consecutive threads) should walk the operand's contiguous axis; for a
    # transposed operand that is the other tile axis, so the two loading threads swap roles.
    A_SWAP = trans_a   # op(A) = A^T: A[k, row] is contiguous along row
    B_SWAP = trans_b   # op(B) = B^T: B[col, k] is contiguous along k

    def gemm_v2(
        M,      # int: rows of op(A) and C
        N,      # int: columns of op(B) and C
        K,      # int: columns of op(A) = rows of op(B)
        alpha,  # scalar (accumulation dtype)
        a,      # [M, K] ([K, M] if trans_a), [Z, ...] if batched
        b,      # [K, N] ([N, K] if trans_b), [Z, ...] if batched
        beta,   # scalar (accumulation dtype)
        c,      # [M, N], [Z, M, N] if batched (read unless beta == 0, written)
    ):
        a_tile = cuda.shared.array((TILE, TILE), ACC_T)  # [TILE, TILE]: op(A)[row0 + i, k0 + kk] at [i, kk]
        b_tile = cuda.shared.array((TILE, TILE), ACC_T)  # [TILE, TILE]: op(B)[k0 + kk, col0 + j] at [kk, j]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row0 = cuda.blockIdx.y * TILE
        col0 = cuda.blockIdx.x * TILE
        z = cuda.blockIdx.z
        acc = ACC(0)
        for k0 in range(0, K, TILE):
            # stage one element of each tile per thread, zero outside the matrices
            ai, ak = (tx, ty) if A_SWAP else (ty, tx)
            inside = row0 + ai < M and k0 + ak < K
            a_tile[ai, ak] = ACC(op_a(a, z, row0 + ai, k0 + ak)) if inside else ACC(0)
            bk, bj = (tx, ty) if B_SWAP else (ty, tx)
            inside = k0 + bk < K and col0 + bj < N
            b_tile[bk, bj] = ACC(op_b(b, z, k0 + bk, col0 + bj)) if inside else ACC(0)
            cuda.syncthreads()
            for kk in range(TILE):  # acc += sum over this k-tile of op(A)[row, k] * op(B)[k, col]
                acc += a_tile[ty, kk] * b_tile[kk, tx]
            cuda.syncthreads()
        if row0 + ty < M and col0 + tx < N:
            update_c(c, z, row0 + ty, col0 + tx, alpha, acc, beta)

    return gemm_v2


def launch_v2(M: int, N: int, Z: int, config: tuple) -> tuple:
    (TILE,) = config
    return (math.ceil(N / TILE), math.ceil(M / TILE), Z), (TILE, TILE, 1)


# --------------------------------------------------------------------------------------------------
# v3
# --------------------------------------------------------------------------------------------------
def make_gemm_v3_pyfunc(dtype: str, trans_a: bool, trans_b: bool, batched: bool,
                        BM: int, BN: int, BK: int, TM: int, TN: int):
    # v3 register blocking: a thread keeps TM x TN sums in registers, so each shared-memory read feeds TM (or TN) FMAs.
    if BM % TM or BN % TN:
        raise ValueError(f"config: BM={BM} must be a multiple of TM={TM} and BN={BN} of TN={TN}")
    ACC = _numpy_scalar(ACCUMULATE[dtype])
    ACC_T = _numba_type(ACCUMULATE[dtype])
    op_a = _op_loader(trans_a, batched)
    op_b = _op_loader(trans_b, batched)
    update_c = _c_updater(dtype, batched)
    TX = BN // TN            # threads along x (columns of C)
    TY = BM // TM            # threads along y (rows of C)
    THREADS = TX * TY
    if (BM * BK) % THREADS or (BK * BN) % THREADS:
        raise ValueError(f"config: the tiles BM*BK={BM * BK} and BK*BN={BK * BN} must be multiples of the "
                         f"{THREADS} threads (BM/TM * BN/TN)")
    # Every thread stages the same fixed number of elements: a constant trip count lets the compiler
    # unroll the staging loops (a grid-stride loop `range(tid, BM*BK, THREADS)` cost 122 registers
    # instead of 68 for the GPU tiles, see numbarnn.analysis.report).
    LOADS_A = BM * BK // THREADS
    LOADS_B = BK * BN // THREADS
    # Thread (ty, tx) owns rows ty + m*TY (m < TM) and columns tx + n*TX (n < TN) of the block tile:
    # strided ownership keeps the C stores and the b_tile reads of a warp on consecutive addresses.
    # Staging order: consecutive threads take consecutive elements along the operand's contiguous axis.
    A_K_FASTEST = not trans_a   # A [M, K]: contiguous along k; A^T stored [K, M]: along rows
    B_N_FASTEST = not trans_b   # B [K, N]: contiguous along n; B^T stored [N, K]: along k

    def gemm_v3(
        M,      # int: rows of op(A) and C
        N,      # int: columns of op(B) and C
        K,      # int: columns of op(A) = rows of op(B)
        alpha,  # scalar (accumulation dtype)
        a,      # [M, K] ([K, M] if trans_a), [Z, ...] if batched
        b,      # [K, N] ([N, K] if trans_b), [Z, ...] if batched
        beta,   # scalar (accumulation dtype)
        c,      # [M, N], [Z, M, N] if batched (read unless beta == 0, written)
    ):
        a_tile = cuda.shared.array((BK, BM), ACC_T)  # [BK, BM]: op(A)[row0 + i, k0 + kk] at [kk, i]
        b_tile = cuda.shared.array((BK, BN), ACC_T)  # [BK, BN]: op(B)[k0 + kk, col0 + j] at [kk, j]
        acc = cuda.local.array((TM, TN), ACC_T)      # [TM, TN]: this thread's sums (registers)
        a_reg = cuda.local.array(TM, ACC_T)          # [TM]: op(A)[its rows, k]
        b_reg = cuda.local.array(TN, ACC_T)          # [TN]: op(B)[k, its columns]
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * TX + tx
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        z = cuda.blockIdx.z
        for m in range(TM):
            for n in range(TN):
                acc[m, n] = ACC(0)
        for k0 in range(0, K, BK):
            # stage the k-tile: THREADS threads copy BM*BK + BK*BN elements, zero outside the matrices
            for load in range(LOADS_A):
                e = tid + load * THREADS   # element of the [BM, BK] tile
                if A_K_FASTEST:
                    i = e // BK
                    kk = e % BK
                else:
                    i = e % BM
                    kk = e // BM
                inside = row0 + i < M and k0 + kk < K
                a_tile[kk, i] = ACC(op_a(a, z, row0 + i, k0 + kk)) if inside else ACC(0)
            for load in range(LOADS_B):
                e = tid + load * THREADS   # element of the [BK, BN] tile
                if B_N_FASTEST:
                    kk = e // BN
                    j = e % BN
                else:
                    kk = e % BK
                    j = e // BK
                inside = k0 + kk < K and col0 + j < N
                b_tile[kk, j] = ACC(op_b(b, z, k0 + kk, col0 + j)) if inside else ACC(0)
            cuda.syncthreads()
            for kk in range(BK):
                for m in range(TM):
                    a_reg[m] = a_tile[kk, ty + m * TY]
                for n in range(TN):
                    b_reg[n] = b_tile[kk, tx + n * TX]
                for m in range(TM):  # outer product: acc[m, n] += op(A)[row_m, k] * op(B)[k, col_n]
                    for n in range(TN):
                        acc[m, n] += a_reg[m] * b_reg[n]
            cuda.syncthreads()
        for m in range(TM):
            for n in range(TN):
                row = row0 + ty + m * TY
                col = col0 + tx + n * TX
                if row < M and col < N:
                    update_c(c, z, row, col, alpha, acc[m, n], beta)

    return gemm_v3


def launch_v3(M: int, N: int, Z: int, config: tuple) -> tuple:
    BM, BN, _BK, TM, TN = config
    return (math.ceil(N / BN), math.ceil(M / BM), Z), (BN // TN, BM // TM, 1)


# --------------------------------------------------------------------------------------------------
# v4
# --------------------------------------------------------------------------------------------------
def make_gemm_v4_pyfunc(dtype: str, trans_a: bool, trans_b: bool, batched: bool,
                        BM: int, BN: int, BK: int, TM: int, TN: int, split: bool = False):
    # v4 8x8 micro-tiles, double-buffered: 4 FMAs per shared load (v3: 2), and the next k-tile's global loads are in flight while this one is computed.
    # split (split-K stage 1): blockIdx.z takes slice z of K, its partial tile goes to c[z] (stage 2: split_k_sum).
    if split and batched:
        raise ValueError("split: split-K uses grid dimension z for the K slices; it has no batched form")
    if BM % TM or BN % TN:
        raise ValueError(f"config: BM={BM} must be a multiple of TM={TM} and BN={BN} of TN={TN}")
    ACC = _numpy_scalar(ACCUMULATE[dtype])
    # Shared-memory indices go through U (unsigned): numba wraps negative indices Python-style, a compare
    # and a select per access for a signed index, and the wrapped addresses cost registers (with BK = 8:
    # 165 -> 148 registers, float32 nn, sm_80); for an unsigned index it emits a plain address.
    U = np.uint64
    ACC_T = _numba_type(ACCUMULATE[dtype])
    op_a = _op_loader(trans_a, batched)
    op_b = _op_loader(trans_b, batched)
    update_c = _c_updater(dtype, batched or split)   # split: c is the partials [Z, M, N]
    SPLIT = split
    TX = BN // TN            # threads along x (columns of C)
    TY = BM // TM            # threads along y (rows of C)
    THREADS = TX * TY
    if (BM * BK) % THREADS or (BK * BN) % THREADS:
        raise ValueError(f"config: the tiles BM*BK={BM * BK} and BK*BN={BK * BN} must be multiples of the "
                         f"{THREADS} threads (BM/TM * BN/TN)")
    LOADS_A = BM * BK // THREADS   # elements of the A k-tile each thread fetches (constant: unrolled)
    LOADS_B = BK * BN // THREADS
    # A k-fastest operand is stored transposed ([kk, i], kk the fast thread index): with rows of BM words
    # (a multiple of 32) the BK threads of one i (one per kk) would all hit bank i; PAD = 32 // BK extra
    # words per row put the warp's 32 stores in 32 different banks (kk * PAD + i covers 0..31).
    PAD = max(1, 32 // BK)
    SA = BM + PAD                  # row length of the shared A tile
    SB = BN + PAD
    # Global loads: numba has no float4 (vector) loads from Python, so the lever for wide, coalesced
    # transactions is that consecutive threads read consecutive addresses: the staging order walks the
    # operand's contiguous axis fastest, as in v3 (a warp's request then covers whole 32-byte sectors).
    A_K_FASTEST = not trans_a      # A [M, K]: contiguous along k; A^T stored [K, M]: along rows
    B_N_FASTEST = not trans_b      # B [K, N]: contiguous along n; B^T stored [N, K]: along k

    def gemm_v4(
        M,      # int: rows of op(A) and C
        N,      # int: columns of op(B) and C
        K,      # int: columns of op(A) = rows of op(B)
        alpha,  # scalar (accumulation dtype)
        a,      # [M, K] ([K, M] if trans_a), [Z, ...] if batched
        b,      # [K, N] ([N, K] if trans_b), [Z, ...] if batched
        beta,   # scalar (accumulation dtype; 0 when split)
        c,      # [M, N], [Z, M, N] if batched (read unless beta == 0, written); split: [Z, M, N] partials
    ):
        a_tile = cuda.shared.array((2, BK, SA), ACC_T)  # [2, BK, BM+pad]: buffer, op(A)[row0 + i, k0 + kk] at [kk, i]
        b_tile = cuda.shared.array((2, BK, SB), ACC_T)  # [2, BK, BN+pad]: buffer, op(B)[k0 + kk, col0 + j] at [kk, j]
        acc = cuda.local.array((TM, TN), ACC_T)         # [TM, TN]: this thread's sums (registers)
        a_reg = cuda.local.array(TM, ACC_T)             # [TM]: op(A)[its rows, k]
        b_reg = cuda.local.array(TN, ACC_T)             # [TN]: op(B)[k, its columns]
        a_next = cuda.local.array(LOADS_A, ACC_T)       # [LOADS_A]: the next A k-tile, in flight (registers)
        b_next = cuda.local.array(LOADS_B, ACC_T)       # [LOADS_B]: the next B k-tile, in flight (registers)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * TX + tx
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        z = cuda.blockIdx.z
        if SPLIT:                       # this block's slice of K: [k_lo, k_hi), whole k-tiles
            kc = (K + cuda.gridDim.z - 1) // cuda.gridDim.z
            kc = (kc + BK - 1) // BK * BK
            k_lo = z * kc
            k_hi = min(K, k_lo + kc)
        else:
            k_lo = 0
            k_hi = K
        for m in range(TM):
            for n in range(TN):
                acc[m, n] = ACC(0)

        # prologue: k-tile 0 into buffer 0 (zeros outside the matrices, also when K == 0)
        for load in range(LOADS_A):
            e = tid + load * THREADS   # element of the [BM, BK] tile
            i = e // BK if A_K_FASTEST else e % BM
            kk = e % BK if A_K_FASTEST else e // BM
            inside = row0 + i < M and k_lo + kk < k_hi
            a_tile[U(0), U(kk), U(i)] = ACC(op_a(a, z, row0 + i, k_lo + kk)) if inside else ACC(0)
        for load in range(LOADS_B):
            e = tid + load * THREADS   # element of the [BK, BN] tile
            kk = e // BN if B_N_FASTEST else e % BK
            j = e % BN if B_N_FASTEST else e // BK
            inside = k_lo + kk < k_hi and col0 + j < N
            b_tile[U(0), U(kk), U(j)] = ACC(op_b(b, z, k_lo + kk, col0 + j)) if inside else ACC(0)
        cuda.syncthreads()

        buf = 0
        for k0 in range(k_lo, k_hi, BK):
            k1 = k0 + BK                # the next k-tile
            more = k1 < k_hi
            if more:                    # 1. issue its global loads (registers; nothing waits on them yet)
                for load in range(LOADS_A):
                    e = tid + load * THREADS
                    i = e // BK if A_K_FASTEST else e % BM
                    kk = e % BK if A_K_FASTEST else e // BM
                    inside = row0 + i < M and k1 + kk < k_hi
                    a_next[load] = ACC(op_a(a, z, row0 + i, k1 + kk)) if inside else ACC(0)
                for load in range(LOADS_B):
                    e = tid + load * THREADS
                    kk = e // BN if B_N_FASTEST else e % BK
                    j = e % BN if B_N_FASTEST else e // BK
                    inside = k1 + kk < k_hi and col0 + j < N
                    b_next[load] = ACC(op_b(b, z, k1 + kk, col0 + j)) if inside else ACC(0)
            for kk in range(BK):        # 2. compute this k-tile from shared buffer `buf`
                for m in range(TM):
                    a_reg[m] = a_tile[U(buf), U(kk), U(ty + m * TY)]
                for n in range(TN):
                    b_reg[n] = b_tile[U(buf), U(kk), U(tx + n * TX)]
                for m in range(TM):     # outer product: acc[m, n] += op(A)[row_m, k] * op(B)[k, col_n]
                    for n in range(TN):
                        acc[m, n] += a_reg[m] * b_reg[n]
            if more:                    # 3. park the next k-tile in the other buffer (nobody reads it now)
                for load in range(LOADS_A):
                    e = tid + load * THREADS
                    i = e // BK if A_K_FASTEST else e % BM
                    kk = e % BK if A_K_FASTEST else e // BM
                    a_tile[U(1 - buf), U(kk), U(i)] = a_next[load]
                for load in range(LOADS_B):
                    e = tid + load * THREADS
                    kk = e // BN if B_N_FASTEST else e % BK
                    j = e % BN if B_N_FASTEST else e // BK
                    b_tile[U(1 - buf), U(kk), U(j)] = b_next[load]
            # one barrier per k-tile (v3: two): buffer 1 - buf is complete for everyone, and everyone is
            # done reading `buf`, which the next iteration overwrites
            cuda.syncthreads()
            buf = 1 - buf
        for m in range(TM):
            for n in range(TN):
                row = row0 + ty + m * TY
                col = col0 + tx + n * TX
                if row < M and col < N:
                    update_c(c, z, row, col, alpha, acc[m, n], beta)

    return gemm_v4


def launch_v4(M: int, N: int, Z: int, config: tuple) -> tuple:
    BM, BN, _BK, TM, TN = config
    return (math.ceil(N / BN), math.ceil(M / BM), Z), (BN // TN, BM // TM, 1)


# --------------------------------------------------------------------------------------------------
# v4 split-K: for outputs of few tiles with a long K (the backward's dx = dgx W at small T*B)
# --------------------------------------------------------------------------------------------------
# A C of M x N has ceil(M/BM) * ceil(N/BN) block tiles; when that is below the number of SMs most of the GPU
# idles while each block walks all of K alone (measured on an H100, LSTM H=768 B=16 T=8: dx = dgx W, M = 128,
# N = 768, K = 3072, ran as 6 blocks for 752 us, 3.5x the input projection's 215 us).  Split-K cuts K into
# Z slices: stage 1 is v4 with blockIdx.z choosing the slice (partials[z] = alpha * op(A)[:, slice] op(B)[slice, :]),
# stage 2 sums the Z partials of each element in a fixed order (deterministic) and adds beta * C.

#: a K slice keeps at least this many k-tiles, so the double-buffered loop still has a pipeline to run
SPLIT_MIN_K_TILES = 16


def split_k_for(M: int, N: int, K: int, config: tuple, sms: int) -> int:
    """How many K slices v4 (tiles `config`) should use for an M x N x K product on `sms` multiprocessors:
    1 when the output already has a block tile per SM, else enough slices for about one block per SM, as long
    as each slice keeps SPLIT_MIN_K_TILES k-tiles."""
    BM, BN, BK = config[:3]
    tiles = cdiv(M, BM) * cdiv(N, BN)
    if tiles >= sms:
        return 1
    return max(1, min(cdiv(sms, tiles), K // BK // SPLIT_MIN_K_TILES))


def make_split_k_sum_pyfunc(dtype: str):
    # split-K stage 2: c = the slices' partials summed in order + beta * c (a thread per element, coalesced).
    ACC = _numpy_scalar(ACCUMULATE[dtype])

    def split_k_sum(
        partials,  # [Z, M, N] stage 1: alpha * op(A)[:, slice z] @ op(B)[slice z, :]
        beta,      # scalar (accumulation dtype)
        c,         # [M, N] out (read unless beta == 0)
    ):
        e = cuda.grid(1)
        M, N = c.shape[0], c.shape[1]
        if e < M * N:
            row = e // N
            col = e - row * N
            total = ACC(0)
            for z in range(partials.shape[0]):     # fixed order: deterministic
                total += ACC(partials[z, row, col])
            if beta == 0:
                c[row, col] = total
            else:
                c[row, col] = total + beta * ACC(c[row, col])

    return split_k_sum


def split_k_sum_signature(dtype: str) -> tuple:
    t = _numba_type(dtype)
    return (types.Array(t, 3, "A"), _numba_type(ACCUMULATE[dtype]), types.Array(t, 2, "A"))


#: threads per block of stage 2 (GPU; the simulator uses 8)
SPLIT_SUM_THREADS = 256


@functools.cache
def get_split_k_sum(dtype: str):
    return cuda.jit(split_k_sum_signature(dtype))(make_split_k_sum_pyfunc(dtype))


def splittable(version: int, dtype: str, batched: bool) -> bool:
    """Whether split-K runs for this product: v4, 2-D operands, a dtype of SPLIT_DTYPES."""
    return version == 4 and not batched and str(dtype) in SPLIT_DTYPES


def auto_split_k(version: int, dtype: str, batched: bool, M: int, N: int, K: int, config: tuple,
                 simulator: bool | None = None) -> int:
    """The slices ``gemm(split_k=None)`` uses (1: no split); launch_plan asks the same."""
    if not splittable(version, dtype, batched) or M * N == 0:
        return 1
    return split_k_for(M, N, K, config, sm_count(simulator))


#: the simulator's nominal SM count: small, yet with SPLIT_MIN_K_TILES the tiny shapes of the tests split
#: only where a test asks for it (explicitly, or by lowering SPLIT_MIN_K_TILES)
SIM_SMS = 4
#: GPU-shaped launches planned or profiled in the simulator: the H100 SXM of the roofline model (132 SMs)
MODEL_SMS = gpus.GPUS["H100 SXM"].sms


def sm_count(simulator: bool | None = None) -> int:
    """Multiprocessors split-K plans for: the current GPU's; SIM_SMS for simulator launch sizes; MODEL_SMS
    for GPU launch sizes where there is no GPU (launch_plan(gpu=True), the profiler's GPU geometry)."""
    if target.simulator(simulator):
        return SIM_SMS
    if numba_config.ENABLE_CUDASIM:
        return MODEL_SMS
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)    # numba caches device attributes
    except Exception:                  # no GPU here (a GPU-shaped launch plan): the model's GPU  # noqa: BLE001
        return MODEL_SMS


# --------------------------------------------------------------------------------------------------
# versions, cached kernels, specs for the kernel report
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmVersion:
    number: int
    title: str
    make_pyfunc: Callable   # (dtype, trans_a, trans_b, batched, *config) -> plain Python kernel function
    launch: Callable        # (M, N, Z, config) -> (grid, block)
    gpu_config: tuple       # tile sizes on a real GPU
    sim_config: tuple       # tile sizes in the CUDA simulator

    def default_config(self) -> tuple:
        return self.sim_config if target.current().simulator else self.gpu_config

    def threads(self, config: tuple) -> int:
        block = self.launch(1, 1, 1, config)[1]
        return block[0] * block[1] * block[2]


VERSIONS = {
    1: GemmVersion(1, "naive", make_gemm_v1_pyfunc, launch_v1, gpu_config=(16, 16), sim_config=(4, 4)),
    2: GemmVersion(2, "shared-memory tiles", make_gemm_v2_pyfunc, launch_v2, gpu_config=(16,), sim_config=(8,)),
    3: GemmVersion(3, "register blocking", make_gemm_v3_pyfunc, launch_v3,
                   gpu_config=(64, 64, 8, 4, 4), sim_config=(8, 8, 4, 2, 2)),
    4: GemmVersion(4, "double buffering", make_gemm_v4_pyfunc, launch_v4,
                   gpu_config=(128, 128, 4, 8, 8), sim_config=(8, 4, 2, 4, 2)),
}

#: the version ``gemm`` / ``matmul`` (and so the RNN and BlockLSTM drivers) use unless told otherwise
DEFAULT_VERSION = 4

#: dtypes split-K runs in: those that accumulate in their own dtype (float16 partials would round each
#: slice's sum to half precision before the sum of the slices)
SPLIT_DTYPES = ("float32", "float64")


def kernel_name(version: int, trans_a: bool, trans_b: bool, batched: bool) -> str:
    """e.g. gemm_v3_nt_batched: n/t = op of A, op of B (BLAS letters)."""
    ops = ("t" if trans_a else "n") + ("t" if trans_b else "n")
    return f"gemm_v{version}_{ops}" + ("_batched" if batched else "")


@functools.cache
def get_kernel(version: int, dtype: str, trans_a: bool = False, trans_b: bool = False,
               batched: bool = False, config: tuple | None = None, split: bool = False):
    """The compiled kernel of one specialisation (cached: each one is compiled once per process)."""
    v = VERSIONS[version]
    config = v.default_config() if config is None else tuple(config)
    extra = {"split": True} if split else {}
    pyfunc = v.make_pyfunc(dtype, bool(trans_a), bool(trans_b), bool(batched), *config, **extra)
    return cuda.jit(kernel_signature(dtype, batched, split))(pyfunc)


def kernel_specs() -> list:
    """(name, dtype, pyfunc, signature, threads per block) of every GEMM specialisation with its GPU tiles,
    for numbarnn.kernels.registry / report (building them compiles nothing)."""
    specs = []
    for number, v in VERSIONS.items():
        for dtype in DTYPES:
            for trans_a in (False, True):
                for trans_b in (False, True):
                    for batched in (False, True):
                        pyfunc = v.make_pyfunc(dtype, trans_a, trans_b, batched, *v.gpu_config)
                        specs.append((kernel_name(number, trans_a, trans_b, batched), dtype, pyfunc,
                                      kernel_signature(dtype, batched), v.threads(v.gpu_config)))
    v4 = VERSIONS[4]
    for dtype in SPLIT_DTYPES:                  # split-K: v4 stage 1 and the stage 2 sum
        for trans_a in (False, True):
            for trans_b in (False, True):
                pyfunc = v4.make_pyfunc(dtype, trans_a, trans_b, False, *v4.gpu_config, split=True)
                specs.append((kernel_name(4, trans_a, trans_b, False) + "_splitk", dtype, pyfunc,
                              kernel_signature(dtype, False, split=True), v4.threads(v4.gpu_config)))
        specs.append(("split_k_sum", dtype, make_split_k_sum_pyfunc(dtype), split_k_sum_signature(dtype),
                      SPLIT_SUM_THREADS))
    return specs


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def _is_device_array(x) -> bool:
    if isinstance(x, np.ndarray):
        return False
    return cuda.devicearray.is_cuda_ndarray(x) or hasattr(x, "__cuda_array_interface__")


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def _check_scalar(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name}: expected a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value


def result_shape(a_shape: tuple, b_shape: tuple, trans_a: bool, trans_b: bool) -> tuple:
    """Shape of C = op(A) @ op(B): (M, N), or (Z, M, N) batched.  ValueError naming the mismatch."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    for name, shape in (("a", a_shape), ("b", b_shape)):
        if len(shape) not in (2, 3):
            raise ValueError(f"{name}: expected rank 2 ([rows, cols]) or 3 ([Z, rows, cols]), "
                             f"got rank {len(shape)} with shape {shape}")
    if len(a_shape) != len(b_shape):
        raise ValueError(f"b: expected rank {len(a_shape)} like a (both 2-D or both 3-D batched), "
                         f"got shape {b_shape} with a {a_shape}")
    batch = ()
    if len(a_shape) == 3:
        if b_shape[0] != a_shape[0]:
            raise ValueError(f"b: expected batch size Z = {a_shape[0]} (the leading dimension of a), "
                             f"got shape {b_shape}")
        batch = a_shape[:1]
    a_2d, b_2d = a_shape[-2:], b_shape[-2:]
    M, K = (a_2d[1], a_2d[0]) if trans_a else a_2d
    Kb, N = (b_2d[1], b_2d[0]) if trans_b else b_2d
    if Kb != K:
        a_what = "[K, M]" if trans_a else "[M, K]"
        b_what = "[N, K]" if trans_b else "[K, N]"
        raise ValueError(f"b: expected {b_what} with K = {K} (a is {a_what} = {a_2d}), got {b_2d}"
                         f" (shapes a {a_shape}, b {b_shape}, trans_a={trans_a}, trans_b={trans_b})")
    return batch + (M, N)


def gemm_shapes(a_shape: tuple, b_shape: tuple, c_shape: tuple, trans_a: bool, trans_b: bool) -> tuple:
    """(Z, M, N, K) of C = op(A) @ op(B), Z = 1 when not batched.  ValueError naming the mismatch."""
    expected = result_shape(a_shape, b_shape, trans_a, trans_b)
    if tuple(c_shape) != expected:
        legend = "[Z, M, N]" if len(expected) == 3 else "[M, N]"
        raise ValueError(f"c: expected shape {legend} = {expected}, got {tuple(c_shape)}")
    K = a_shape[-2] if trans_a else a_shape[-1]
    Z = expected[0] if len(expected) == 3 else 1
    return Z, expected[-2], expected[-1], K


def gemm(a, b, c, *, alpha=1.0, beta=0.0, trans_a=False, trans_b=False, version=None, stream=0, config=None,
         split_k=None, scratch=None, log=None):
    """C = alpha * op(A) @ op(B) + beta * C on the device, in place; returns c.

    a, b, c: numba device arrays (or any CUDA array), 2-D, or 3-D with a leading batch dimension Z;
             views with any strides work (a transposed view plus the matching flag is free).
             op(A) [M, K] (a is [K, M] if trans_a), op(B) [K, N] (b is [N, K] if trans_b), c [M, N].
    alpha, beta: real numbers; beta == 0 means c is write-only.
    version: 1, 2, 3 or 4 (see VERSIONS; default DEFAULT_VERSION = 4); config: tile sizes of that
             version (default: the GPU or the simulator tiles of VERSIONS[version]).
    stream: a CUDA stream or 0 (the default stream).
    split_k: slices of K (v4 split-K, two launches): None = automatic where it applies (v4, not batched,
             float32/float64: ``split_k_for`` on this GPU's SMs), 1 = never, n > 1 = n slices.
    scratch: ``scratch(name, shape, dtype)`` -> a device array for split-K's partials (the RNN driver's
             workspace); default a new array per call.
    log: an object with ``count(name)`` (the driver's LaunchLog): each launch is counted there, as "gemm"
         or "split_k_sum".
    """
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not _is_device_array(x):
            raise ArgumentTypeError(f"{name}: expected a device array (numba.cuda.to_device / device_array), "
                            f"got {type(x).__name__}; use numbarnn.kernels.gemm.matmul for NumPy arrays")
    dtype = str(check_same_dtype({"a": a, "b": b, "c": c}))
    trans_a = _check_flag("trans_a", trans_a)
    trans_b = _check_flag("trans_b", trans_b)
    alpha = _check_scalar("alpha", alpha)
    beta = _check_scalar("beta", beta)
    if version is None:
        version = DEFAULT_VERSION
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {sorted(VERSIONS)}, got {version!r}")
    Z, M, N, K = gemm_shapes(shape_of(a), shape_of(b), shape_of(c), trans_a, trans_b)
    batched = len(shape_of(a)) == 3
    if M == 0 or N == 0 or Z == 0:
        return c  # nothing to write
    v = VERSIONS[version]
    config = v.default_config() if config is None else tuple(config)
    if split_k is None:
        split_k = auto_split_k(version, dtype, batched, M, N, K, config)
    elif isinstance(split_k, (bool, np.bool_)) or not isinstance(split_k, (int, np.integer)) or split_k < 1:
        raise ValueError(f"split_k: expected None or an integer >= 1, got {split_k!r}")
    elif split_k > 1 and not splittable(version, dtype, batched):
        raise ValueError(f"split_k: split-K runs with version 4, 2-D operands and float32/float64; got version "
                         f"{version}, {'batched' if batched else '2-D'}, {dtype}")
    split_k = int(split_k)
    grid, block = v.launch(M, N, Z if split_k == 1 else split_k, config)
    if grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"a: M = {M} and batch Z = {Z} (split_k {split_k}) need a grid of {grid}, over the "
                         f"CUDA limit of {_MAX_GRID_YZ} blocks in y and z")
    if split_k == 1:
        launch(get_kernel(version, dtype, trans_a, trans_b, batched, config), grid, block,
               M, N, K, alpha, a, b, beta, c, stream=stream)
        if log is not None:
            log.count("gemm")
        return c
    # split-K: stage 1 writes each slice's partial product, stage 2 sums them in order and adds beta * C
    partials = (cuda.device_array((split_k, M, N), dtype=dtype) if scratch is None   # [Z, M, N]
                else scratch("split_k_partials", (split_k, M, N), dtype))
    launch(get_kernel(4, dtype, trans_a, trans_b, False, config, split=True), grid, block,
           M, N, K, alpha, a, b, 0.0, partials, stream=stream)
    t = common.threads(M * N, SPLIT_SUM_THREADS)
    launch(get_split_k_sum(dtype), common.blocks(M * N, t), t, partials, beta, c, stream=stream)
    if log is not None:
        log.count("gemm")
        log.count("split_k_sum")
    return c


def matmul(a, b, c=None, *, alpha=1.0, beta=0.0, trans_a=False, trans_b=False, version=None, config=None):
    """NumPy convenience: copies a, b (and c) to the device, runs ``gemm`` and returns C as a NumPy array.

    Without c, C starts as zeros of the inputs' dtype (beta is then irrelevant).  For tests and teaching:
    real code keeps its operands on the device and calls ``gemm``.
    """
    a = np.ascontiguousarray(a)  # host side only: the device copy needs one contiguous buffer
    b = np.ascontiguousarray(b)
    if c is None:
        c = np.zeros(result_shape(a.shape, b.shape, bool(trans_a), bool(trans_b)), dtype=a.dtype)
    c = np.ascontiguousarray(c)
    d_a, d_b, d_c = cuda.to_device(a), cuda.to_device(b), cuda.to_device(c)
    gemm(d_a, d_b, d_c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b, version=version,
         config=config)
    return d_c.copy_to_host()

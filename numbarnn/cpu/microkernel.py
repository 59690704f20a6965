"""The fused loops' micro-kernel and what its shape depends on: the host's vector registers, the tile shapes, the
packed weight panels it reads.

The micro-kernel keeps V*NR vector accumulators in registers across the k loop (per k: one vector load per
gate, one broadcast per row, V*NR fused multiply-adds), in G // V passes over k (`tile_shape`: everything a
pass holds must fit the vector registers: AVX-512 runs the LSTM's 4 gates x 4 rows in one pass, AVX2 two
passes of 2 gates x 4 rows).  It is written in LLVM IR through llvmlite (numba's own code generator) because
LLVM does not find that register blocking in a scalar loop (numba loops ran at a few GFLOP/s); it runs at a
core's FMA peak (`python bench/bench_cpu_fused.py`).

`tile_shape` is measured on the machine at first use (tuning.py) with a static rule as the fallback, and so is
`wide_rows`, a wider tile in the same passes for most of a row group (AVX2's LSTM: 2 x 6 and 2 x 4 for the rest);
`geometry` is what a compiled loop and its panels depend on besides the call.  `pack` and `pack_columns` lay W, R (and
R's columns for the backward) out as the panels `product_tile` reads (`panel_shape`).
"""
from __future__ import annotations

import functools
import platform

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .jitcache import njit_cached

#: vector registers the micro-kernel may fill with accumulators (of 32 with AVX-512, 16 with AVX2)
ACCUMULATORS = {32: 16, 16: 12}


@functools.cache
def simd_bytes() -> int:
    """The host's vector width in bytes (numba compiles for the host CPU)."""
    features = llvm_binding.get_host_cpu_features()
    if features.get("avx512f"):
        return 64
    if features.get("avx"):
        return 32
    return 16


def lanes_for(compute) -> int:
    """Units per tile: one vector register of the compute dtype (16 float32 with AVX-512)."""
    return simd_bytes() // np.dtype(compute).itemsize


@functools.cache
def machine() -> str:
    """The host's architecture, as `platform.machine()` names it (x86_64, aarch64, arm64, ...); asked once (the
    tile-shape rules ask it ~180 times a call)."""
    return platform.machine().lower()


def registers() -> int:
    """Vector registers of the host's ISA: 32 with AVX-512 and on AArch64 (NEON's v0-v31: Apple silicon,
    Graviton; 16-byte vectors), 16 with AVX/AVX2 and SSE."""
    return 32 if simd_bytes() == 64 or machine() in ("aarch64", "arm64") else 16


def fits(V: int, NR: int, regs: int | None = None) -> bool:
    """A micro-kernel pass of V vectors x NR rows keeps its accumulators in registers: V*NR of them (at most
    ACCUMULATORS), plus V panel vectors and one broadcast row value (`regs`: the host's `registers()`)."""
    regs = registers() if regs is None else regs
    return V * NR <= ACCUMULATORS[regs] and V * NR + V + 1 <= regs


def vectors_per_pass(G: int, NR: int) -> int:
    """V, the vectors one k loop of `product_tile` accumulates for NR rows: the largest divisor of G that
    `fits` (G // V passes over k).  AVX-512: V = G for every built-in cell.  AVX2 (16 registers), LSTM: two
    passes of 2 gates x 4 rows (one pass of 4 gates x 3 rows needs 17 registers: LLVM spills, half the speed)."""
    shape = tile_shape(G)
    return shape[0] if NR == shape[1] else _vectors_per_pass(G, NR, registers())   # the chosen pass, or the rule


@functools.cache
def _vectors_per_pass(G: int, NR: int, regs: int) -> int:
    return max([V for V in range(1, G + 1) if G % V == 0 and fits(V, NR, regs)], default=1)


def tile_shape(G: int) -> tuple[int, int]:
    """(V, NR) for a product of G vectors (gates, or column vectors), as measured on this machine at first use
    (`tuning.chosen`, kept on disk), or with NUMBARNN_CPU_TUNE=0 the static rule: the most accumulators that
    `fit`, then the fewest loads per multiply-add ((V + NR) / (V * NR)).  NR is a power of two (batch sizes
    mostly are: a partial row tile computes spare rows), at most 4 with 32 registers (LSTM 4 gates x 4 rows)
    and 8 with 16 (`python bench/bench_cpu_fused.py --tile-shapes` times the shapes)."""
    return _chosen_shape(G, registers(), simd_bytes())


def geometry(G: int) -> tuple[int, int, int, int]:
    """(vector width in bytes, V, NR, NRW): what a fused loop's compiled code and its panels' shapes depend on
    besides the call, for a product of G vectors (the forward's G gates of `units_per_pass(G)` unit tiles).  The
    plans' caches key it (network.py): the tuner may change the tile, and tests build the loops for another ISA's
    width in the same process."""
    GU = G * units_per_pass(G)
    return (simd_bytes(),) + tile_shape(GU) + (wide_rows(GU),)


def units_per_pass(G: int) -> int:
    """U, the unit tiles one pass of the fused forward's micro-kernel covers for a cell of G gates: 2 for a cell
    of one gate (the tanh and relu RNNs: its two vectors a pass are two unit tiles, `pack`), else 1.  Why: a pass of
    one vector broadcasts a row value per multiply-add (AVX2's 1 x 8 tile: 61 GFLOP/s on Zen 4 alone), two vectors
    run the 2 x 6 tile (87-90, bench/results/cpu.md)."""
    return 2 if G == 1 else 1


def wide_rows(G: int) -> int:
    """NRW, the rows of the fused loops' wide tile for a product of G vectors: the tile (V, NR) of `tile_shape`
    widened to NR + NR // 2 rows in the same V (the same panels), with tiles of NR rows for what is left of a row
    group; NR where there is no wider tile.  Why: one k of a V x NR pass loads V panel vectors and broadcasts NR
    row values for V*NR multiply-adds; AVX2's LSTM at 2 x 4 has 8 accumulators, just the FMA units' latency
    times their count, and 2 x 6 has 12 and loads 0.67 values per multiply-add instead of 0.75 (measured at first
    use like the tile, `tuning.chosen_wide`; with NUMBARNN_CPU_TUNE=0 the rule `wide_rule`)."""
    return _chosen_wide(G, registers(), simd_bytes())


@functools.cache
def _chosen_wide(G: int, regs: int, simd: int) -> int:
    from . import tuning  # lazy: cycle: tuning imports microkernel
    return tuning.chosen_wide(G, regs, simd)


def wide_candidate(V: int, NR: int, regs: int) -> int:
    """The wide tile worth measuring for the tile (V, NR): NR + NR // 2 rows where its accumulators, V panel
    vectors and a broadcast fit the registers and V >= 2 (one vector a pass broadcasts a row value per
    multiply-add however wide the tile: 1 x 12 ran slower than 1 x 8 on Zen 4); else NR.  AVX-512's LSTM: 4 x 6,
    24 accumulators, more than `fits` allows the tile itself (not measured on such a core yet: the tuner decides)."""
    NRW = NR + NR // 2
    return NRW if V >= 2 and NR >= 2 and V * NRW + V + 1 <= regs else NR


def wide_rule(G: int, regs: int) -> int:
    """`wide_rows` without measuring: the wide candidate of G's tile shape where it also `fits` (AVX2's 2 x 6, as
    measured on Zen 4; not AVX-512's 4 x 6)."""
    V, NR = tile_shape(G)
    NRW = wide_candidate(V, NR, regs)
    return NRW if fits(V, NRW, regs) else NR


@functools.cache
def _chosen_shape(G: int, regs: int, simd: int) -> tuple[int, int]:
    """`tile_shape` as this machine measured it (`tuning.chosen`; the static rule with NUMBARNN_CPU_TUNE=0)."""
    from . import tuning  # lazy: cycle: tuning imports microkernel
    return tuning.chosen(G, regs, simd)


@functools.cache
def _tile_shape(G: int, regs: int) -> tuple[int, int]:
    """`tile_shape` for a host of `regs` vector registers (worked out once per call signature's G: every call
    asks)."""
    nr_max = 4 if regs == 32 else 8
    shapes = [(V, NR) for V in range(1, G + 1) if G % V == 0
              for NR in (1, 2, 4, 8) if NR <= nr_max and fits(V, NR, regs)]
    return max(shapes, key=lambda s: (s[0] * s[1], -(s[0] + s[1])), default=(1, 1))


def rows_for(G: int) -> int:
    """NR, batch rows per tile of a product of G vectors (`tile_shape`)."""
    return tile_shape(G)[1]


@functools.cache
def product_tile(compute: str, G: int, NR: int, LANES: int, V: int | None = None, bias: bool = False,
                 out_rows: int | None = None):
    """The micro-kernel, an njit intrinsic:

        product_tile(panel,   # int     address of a packed panel [G // V, K, V, LANES] (`pack`, `panel_shape`)
                     rows,    # [NR]    int64 addresses of NR rows of K values (x or h rows, contiguous)
                     K,       # int
                     out,     # [G, OR, LANES] pointer to the results: rows 0 .. NR-1 of each g overwritten
                     b)       # int     (only with `bias`) address of [G, LANES] values every row starts from

    out[g, r, u] = b[g, u] + sum_k panel[g // V, k, g % V, u] * row_r[k] (b = 0 without `bias`), k in order
    (fused multiply-add where the CPU has one).

    G // V passes over k, each V vectors x NR rows of accumulators (V: `vectors_per_pass` unless given), each
    over its own contiguous part of the panel (passes over one [K, G, LANES] panel would each pull both halves
    of every k's cache lines).  The bias as the accumulators' start, not added by the fused forward's gather
    (2*G*NR slice loops of LANES per tile).  OR (`out_rows`, NR unless given): the rows per g of `out`, so that
    a tile of fewer rows writes into the scratch of a wider one (the fused loops' last tiles, `wide_rows`).
    """
    V = vectors_per_pass(G, NR) if V is None else V
    OR = NR if out_rows is None else out_rows
    if G % V:
        raise ValueError(f"product_tile: V={V} must divide G={G}")
    flt = ir.FloatType() if np.dtype(compute) == np.float32 else ir.DoubleType()
    vec = ir.VectorType(flt, LANES)
    i32, i64 = ir.IntType(32), ir.IntType(64)
    item = np.dtype(compute).itemsize

    def pointer(builder, value, numba_type, llvm_type):
        """A stack pointer as it is; an integer address (`arr.ctypes.data`) as a pointer."""
        if isinstance(numba_type, types.Integer):
            return builder.inttoptr(value, llvm_type.as_pointer())
        return builder.bitcast(value, llvm_type.as_pointer())

    def typer(panel, rows, K, out, *b):
        for name, arg in (("rows", rows), ("out", out)):
            if not isinstance(arg, (types.CPointer, types.Integer)):
                raise TypeError(f"product_tile: {name} must be a pointer or an address, got {arg}")
        sig = types.void(types.intp, rows, types.intp, out, *[types.intp] * len(b))

        def codegen(context, builder, signature, args):
            panel_i, rows_v, K_v, out_v = args[:4]
            rows_p = pointer(builder, rows_v, signature.args[1], i64)
            out = pointer(builder, out_v, signature.args[3], flt)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                                 f"llvm.fmuladd.v{LANES}f{8 * item}")
            a = builder.inttoptr(panel_i, flt.as_pointer())
            row = [builder.inttoptr(builder.load(builder.gep(rows_p, [ir.Constant(i64, r)])), flt.as_pointer())
                   for r in range(NR)]
            splat = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
            undef = ir.Constant(vec, ir.Undefined)
            zero = ir.Constant(vec, [0.0] * LANES)

            def vector_at(base, offset):
                return builder.bitcast(builder.gep(base, [offset]), vec.as_pointer())

            if bias:                                    # the accumulators' start: b[g, :]
                b = builder.inttoptr(args[4], flt.as_pointer())
                start = [builder.load(vector_at(b, ir.Constant(i64, g * LANES)), align=item) for g in range(G)]
            else:
                start = [zero] * G

            for g0 in range(0, G, V):                   # one pass over k per V vectors
                entry = builder.block
                head = builder.append_basic_block(f"tile.head{g0}")
                body = builder.append_basic_block(f"tile.body{g0}")
                done = builder.append_basic_block(f"tile.done{g0}")
                builder.branch(head)
                builder.position_at_end(head)
                k = builder.phi(i64)
                k.add_incoming(ir.Constant(i64, 0), entry)
                acc = [[builder.phi(vec) for _ in range(NR)] for _ in range(V)]     # acc[g - g0][r]
                for g in range(V):
                    for r in range(NR):
                        acc[g][r].add_incoming(start[g0 + g], entry)
                builder.cbranch(builder.icmp_signed("<", k, K_v), body, done)

                builder.position_at_end(body)
                base = builder.add(builder.mul(K_v, ir.Constant(i64, g0 * LANES)),    # pass g0 // V
                                   builder.mul(k, ir.Constant(i64, V * LANES)))
                w = [builder.load(vector_at(a, builder.add(base, ir.Constant(i64, g * LANES))), align=item)
                     for g in range(V)]                                              # panel[g0 // V, k, g, :]
                new = [[None] * NR for _ in range(V)]
                for r in range(NR):
                    scalar = builder.load(builder.gep(row[r], [k]))                 # row_r[k], broadcast
                    hv = builder.shuffle_vector(builder.insert_element(undef, scalar, ir.Constant(i32, 0)),
                                                undef, splat)
                    for g in range(V):
                        new[g][r] = builder.call(fma, [w[g], hv, acc[g][r]])
                for g in range(V):
                    for r in range(NR):
                        acc[g][r].add_incoming(new[g][r], body)
                k.add_incoming(builder.add(k, ir.Constant(i64, 1)), body)
                builder.branch(head)

                builder.position_at_end(done)
                for g in range(V):
                    for r in range(NR):
                        at = ir.Constant(i64, ((g0 + g) * OR + r) * LANES)
                        builder.store(acc[g][r], vector_at(out, at), align=item)
            return context.get_dummy_value()

        return sig, codegen

    if bias:
        @intrinsic
        def tile(typingctx, panel, rows, K, out, b):
            return typer(panel, rows, K, out, b)
    else:
        @intrinsic
        def tile(typingctx, panel, rows, K, out):
            return typer(panel, rows, K, out)
    return tile


def panel_shape(tiles: int, K: int, G: int, compute, NR: int | None = None) -> tuple:
    """The shape of `tiles` packed panels of G vectors over K for a micro-kernel of NR rows (its own
    `tile_shape` NR unless given): [tiles, G // V, K, V, LANES], V = `vectors_per_pass(G, NR)`, the vectors of
    one pass of the `product_tile` that reads it.  (The forward's projection reads W_proj's MQ column vectors
    with the forward's NR, rows_for(G): with V from tile_shape(MQ) instead, an AVX2 cell of G = 1 or 5 read
    its panel in the wrong layout.)"""
    V = vectors_per_pass(G, rows_for(G) if NR is None else NR)
    return (tiles, G // V, K, V, lanes_for(compute))


@njit_cached
def pack(
    W,        # [G*H, K]  a gate-stacked weight matrix (W or R)
    out,      # [NT, G*U//V, K, V, LANES] out (`panel_shape` of G*U vectors): tile jt holds, as its vector
              #           w = p*V + v at [jt, p, :, v], units (jt*U + w // G)*LANES .. +LANES of gate w % G, zeros
              #           past H (U = 1: gate p*V + v of unit tile jt)
    U=1,      # int       unit tiles per tile (`units_per_pass`)
):
    NT, NP, K, V, LANES = out.shape
    G = NP * V // U
    H = W.shape[0] // G
    for jt in range(NT):
        for p in range(NP):
            for v in range(V):
                g = (p * V + v) % G
                for u in range(LANES):
                    j = (jt * U + (p * V + v) // G) * LANES + u
                    if j < H:
                        for k in range(K):
                            out[jt, p, k, v, u] = W[g * H + j, k]
                    else:
                        for k in range(K):
                            out[jt, p, k, v, u] = 0.0


def bias_tiles(b, H: int, NT: int, LANES: int, out):
    """out [NT, G, LANES] = the gate-stacked bias b [G*H] by unit tiles (`pack`'s units), zeros past H."""
    G = b.shape[0] // H
    padded = np.zeros((G, NT * LANES), out.dtype)
    padded[:, :H] = b.reshape(G, H)
    out[...] = padded.reshape(G, NT, LANES).transpose(1, 0, 2)
    return out


@njit_cached
def pack_columns(
    R,        # [K, P]  (R: K = G*H rows, P columns)
    out,      # [NC, MV//V, K, V, LANES] out (`panel_shape` of MV vectors): column tile ct holds columns
              #           (ct*MV + p*V + v)*LANES + u at [ct, p, :, v, u], zeros past P
):
    """Row by row: each row of R is read once, in order, and written as V*LANES-wide pieces to its place in
    every panel (column tile by column tile, the rows 2 KB apart, made the reads strided: 3-6x slower at
    G*H = 2048, P = 512)."""
    NC, NP, K, V, LANES = out.shape
    P = R.shape[1]
    W = V * LANES                                   # columns of one panel piece [V, LANES]
    pieces = out.reshape((NC * NP, K, W))           # [NC*NP, K, V*LANES] the same memory
    whole = P // W                                  # pieces with no column past P
    for k in range(K):
        for q in range(whole):
            for i in range(W):
                pieces[q, k, i] = R[k, q * W + i]
        for q in range(whole, NC * NP):
            for i in range(W):
                col = q * W + i
                pieces[q, k, i] = R[k, col] if col < P else 0.0

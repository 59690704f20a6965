"""The micro-kernel's tile shape chosen by measuring it on the machine that runs it, once per CPU.

`microkernel.tile_shape(G)` is the (V, NR) of a product of G vectors: V vectors per pass over k (G // V passes), NR
batch rows per tile.  Its static rule (`microkernel._tile_shape`: the most accumulators that fit in the registers,
then the fewest loads per multiply-add) was measured on AMD Zen 3 and Zen 4; other cores (Intel's AVX-512
parts, with two FMA ports, or ARM) can prefer another shape.  So at the first call that needs a shape for G,
`chosen` times the micro-kernel alone on one thread for each shape that fits the registers (float32, panels of
2048 rows in cache, as in the op: about a second per shape, mostly compiling it; ROUNDS interleaved rounds, each
shape's best kept), keeps the fastest where it beats the static rule's by MARGIN, and writes it to a small JSON
file beside numba's on-disk cache, keyed by the CPU (`cpu_model`) and vector width: later processes on that
machine read it.  Float64 uses float32's choice (the same registers, half the lanes).

The fused loops' wide tile (`microkernel.wide_rows`: NR + NR // 2 rows where the registers allow) is measured
the same way against the chosen tile (`chosen_wide`).

    NUMBARNN_CPU_TUNE=0      the static rule everywhere (no measurement, no file read)
    numbarnn.cpu.tuning.table()      what this machine chose (numbarnn bench prints it)

Processes that measure at once (test workers, DDP ranks) may both measure; the file is read, updated and
replaced under a lock (`jitcache`), so neither loses the other's entries.  A file that cannot be read or
written is ignored (the shape is then measured in each process, or the static rule used where measuring fails).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import tempfile
import time
import warnings

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from numba import njit, prange

from .. import settings
from ..util import cdiv
from . import microkernel
from .jitcache import _exclusive

FILENAME = "numbarnn_tile_shapes.json"
_measured: dict = {}          # this process's choices: key -> (V, NR)


def enabled() -> bool:
    """Whether shapes are measured (`settings`: NUMBARNN_CPU_TUNE, default on)."""
    return settings.get("cpu_tune")


@functools.cache
def cpu_model() -> str:
    """The CPU, as the choices are keyed: its model name, the core LLVM compiles for, and the family and model
    numbers. A cloud VM may publish one name ("AMD EPYC") for different cores (Zen 3 and Zen 4), so the name
    alone would carry one core's measurement to another."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read(1 << 16)
    except OSError:
        text = ""
    return describe_cpu(text, llvm_binding.get_host_cpu_name())


def describe_cpu(cpuinfo: str, core: str = "") -> str:
    """'name (core, family F model M)' from /proc/cpuinfo (the first processor's fields) and LLVM's host core
    name; the platform's processor name where cpuinfo names none."""
    fields: dict = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())     # the first processor's, and ARM's "Hardware"
    name = next((fields[k] for k in ("model name", "cpu model", "hardware") if fields.get(k)), "")
    name = name or platform.processor() or platform.machine()
    detail = [core] if core and core != "generic" else []
    if fields.get("cpu family") and fields.get("model"):
        detail.append(f"family {fields['cpu family']} model {fields['model']}")
    return f"{name} ({', '.join(detail)})" if detail else name


def cache_path() -> str:
    """Where the choices are kept: numba's cache directory when NUMBA_CACHE_DIR sets one, else this package's
    __pycache__ (where numba caches the fused loops), else the user's temporary directory."""
    base = numba.config.CACHE_DIR
    places = [os.path.join(base, "numbarnn")] if base else []
    places += [os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__"),
               os.path.join(tempfile.gettempdir(), "numbarnn")]
    for place in places:
        try:
            os.makedirs(place, exist_ok=True)
            if os.access(place, os.W_OK):
                return os.path.join(place, FILENAME)
        except OSError:
            continue
    return os.path.join(places[-1], FILENAME)


def key(G: int, regs: int, simd: int) -> str:
    return f"{cpu_model()} | {8 * simd}-bit vectors, {regs} registers | G={G}"


def candidates(G: int, regs: int) -> list:
    """The (V, NR) shapes worth timing for G: every one that fits the registers (`microkernel.fits`) with at least 4
    accumulators (fewer, one row or one vector at a time, is never faster), NR a power of two up to the static
    rule's limit, in the static rule's order (its choice first)."""
    nr_max = 4 if regs == 32 else 8
    shapes = [(V, NR) for V in range(1, G + 1) if G % V == 0
              for NR in (1, 2, 4, 8) if NR <= nr_max and V * NR >= 4 and microkernel.fits(V, NR, regs)]
    return sorted(shapes, key=lambda s: (-(s[0] * s[1]), s[0] + s[1]))


#: rounds of timing, every candidate once per round (interleaved: a drift of the machine's speed, which a shared
#: VM shows within seconds, reaches every candidate alike); each keeps its best round
ROUNDS = 3

#: another shape replaces the static rule's only when it is this much faster: on a noisy machine a lead of a few
#: percent is noise, and a shape kept on disk by noise slows every later process (bench/results/cpu.md)
MARGIN = 0.05


def chosen(G: int, regs: int, simd: int) -> tuple[int, int]:
    """The tile shape for a product of G vectors on this machine: the file's entry, else measured now (and
    written), else the static rule (tuning off, or the measurement failed)."""
    static = microkernel._tile_shape(G, regs)
    if not enabled():
        return static
    return _choose(key(G, regs, simd), "shape", candidates(G, regs) or [static], static,
                   lambda shape: measure(G, *shape), lambda shape: "{}x{}".format(*shape),
                   f"the micro-kernel's tile shapes failed; using {static} for G={G}")


def chosen_wide(G: int, regs: int, simd: int) -> int:
    """The fused loops' wide tile rows for G vectors on this machine (`microkernel.wide_rows`): the file's entry,
    else measured now (the tile (V, NR) against (V, NRW) over the same rows, in rounds, as `chosen`) and written,
    else the rule (`microkernel.wide_rule`)."""
    V, NR = microkernel.tile_shape(G)
    static = microkernel.wide_rule(G, regs)
    wide = microkernel.wide_candidate(V, NR, regs)
    if not enabled() or wide == NR:
        return static
    rows = NR * wide                    # whole tiles of either
    return _choose(key(G, regs, simd) + f" | wide rows of {V}x{NR}", "rows", [NR, wide], static,
                   lambda nr: measure(G, V, nr, B=rows), lambda nr: f"{V}x{nr}",
                   f"the micro-kernel's wide tile failed; using {static} rows for G={G}")


def _choose(k: str, field: str, options: list, static, timed, label, failed: str):
    """This machine's choice under key k among `options` (the static rule's `static` kept unless another is MARGIN
    faster, `pick`): this process's, else the file's entry `field` (if still an option or the rule's), else timed
    now, `timed(option)` -> GFLOP/s, in ROUNDS interleaved rounds, each option's best kept, and written with every
    option's figure (`label(option)`); the rule where timing fails (warned: "numbarnn: measuring " + `failed`)."""
    if k in _measured:
        return _measured[k]
    entry = _read().get(k)
    kept = entry.get(field) if entry is not None else None
    kept = tuple(kept) if isinstance(kept, list) else kept
    if kept is not None and kept in options + [static]:
        _measured[k] = kept
        return kept
    gflops = dict.fromkeys(options, 0.0)
    try:
        for _ in range(ROUNDS):
            for option in options:
                gflops[option] = max(gflops[option], timed(option))
    except Exception:         # pragma: no cover - a compile or run failure: the static rule, said once
        warnings.warn("numbarnn: measuring " + failed, stacklevel=3)
        _measured[k] = static
        return static
    finally:
        _timed_product.cache_clear()            # (each option's panels and rows: a few MB, not kept past the rounds)
    best = pick(gflops, static)
    _measured[k] = best

    def stored(option):
        return list(option) if isinstance(option, tuple) else option
    _update(k, {field: stored(best), "static": stored(static),
                "gflops": {label(option): round(g, 1) for option, g in gflops.items()},
                "measured": time.strftime("%Y-%m-%d")})
    return best


def pick(gflops: dict, static: tuple) -> tuple:
    """The fastest shape of {shape: GFLOP/s}, if it beats the static rule's by MARGIN; else the static rule's."""
    best = max(gflops, key=gflops.get)
    if static in gflops and gflops[best] < gflops[static] * (1 + MARGIN):
        return static
    return best


def measure(G: int, V: int, NR: int, K: int = 256, B: int = 32, repeats: int = 5) -> float:
    """GFLOP/s of `microkernel.product_tile` for (V, NR) on one thread, float32: panels of 2048 rows over K, B rows
    (a partial last tile where NR does not divide B), every unit tile of every row tile, best of `repeats`.  The
    first call per shape compiles it and checks its product; later calls (`chosen`'s rounds) only time it."""
    run, flops = _timed_product(G, V, NR, K, B)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, run())
    return flops / best / 1e9


@functools.lru_cache(maxsize=64)
def _timed_product(G: int, V: int, NR: int, K: int, B: int):
    """(() -> seconds of one run of `steps` steps of the micro-kernel (V, NR) over its panels and rows, the
    floating-point operations of that run), compiled and its product checked against NumPy's once."""
    ct = np.float32
    LANES = microkernel.lanes_for(ct)
    tile = microkernel.product_tile("float32", G, NR, LANES, V)
    NT = max(1, 2048 // (G * LANES))
    rng = np.random.default_rng(0)
    R = rng.standard_normal((G * NT * LANES, K)).astype(ct)          # [G*NT*LANES, K]
    Rp = np.empty((NT, G // V, K, V, LANES), ct)                      # packed as the op packs it
    microkernel.pack(R, Rp)
    NB = cdiv(B, NR)
    h = rng.standard_normal((NB * NR, K)).astype(ct)                 # [NB*NR, K]
    rows = np.array([[h[i + r].ctypes.data for r in range(NR)] for i in range(0, NB * NR, NR)], np.int64)
    out = np.empty((NT, NB, G, NR, LANES), ct)                        # [NT, NB, G, NR, LANES]
    run = steps_runner(tile)
    run(Rp, rows, out, 1)
    got = out.transpose(2, 0, 4, 1, 3).reshape(G * NT * LANES, NB * NR)   # [g, jt, u] x [bt, r]
    want = R @ h.T
    if np.abs(got - want).max() > 1e-3 * np.abs(want).max():
        raise RuntimeError(f"tile shape {V}x{NR}: the micro-kernel's product is wrong")

    steps = 4

    def once() -> float:
        h  # noqa: B018  (rows holds the addresses of h's rows: h lives as long as this function)
        t0 = time.perf_counter()
        run(Rp, rows, out, steps)
        return time.perf_counter() - t0
    return once, 2.0 * G * NT * LANES * K * NB * NR * steps


def steps_runner(tile, parallel: bool = False):
    """`steps` x (every row tile x every unit tile) calls of the micro-kernel `tile`, as the fused loop makes
    them (`parallel`: the row tiles split over numba's threads): what `measure` and bench/bench_cpu_fused.py
    time.  run(Rp [NT, G//V, K, V, LANES], rows [NB, NR] row addresses, out [NT, NB, G, NR, LANES], steps)."""
    @njit(parallel=parallel)
    def run(Rp, rows, out, steps):
        panel = Rp[0].size * Rp.itemsize
        for _ in range(steps):
            for bt in prange(rows.shape[0]):
                for jt in range(Rp.shape[0]):
                    tile(Rp.ctypes.data + jt * panel, rows[bt].ctypes.data, Rp.shape[2], out[jt, bt].ctypes.data)
    return run


def table() -> dict:
    """This machine's entries in the file (key -> entry), and this process's choices not yet written."""
    mine = {k: v for k, v in _read().items() if k.startswith(cpu_model() + " |")}
    mine.update({k: {"shape": list(v)} if isinstance(v, tuple) else {"rows": v}
                 for k, v in _measured.items() if k not in mine})
    return mine


def _read() -> dict:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _update(k: str, entry: dict) -> None:
    """Add one entry: read, update and replace the file under its lock (other processes' entries kept)."""
    path = cache_path()
    try:
        with _exclusive(path + ".lock"):
            data = _read()
            data[k] = entry
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tile_shapes")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError:           # a read-only place: measured again by the next process
        pass

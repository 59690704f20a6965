"""What the GPU would execute, without a GPU: the SASS of a kernel's hot loops (a proxy of its time).

nvJitLink links a kernel's PTX to a cubin for sm_XY (as the compile report does) and nvdisasm
(``pip install 'cuda-toolkit[nvdisasm]==13.*'``, part of numbarnn's ``cuda`` extra) prints its machine code.
A loop is a backward branch: its body runs from the branch's target label to the branch.  The loops that
matter are the ones with floating-point multiply-adds: the innermost one is the recurrent product's k
loop, the one around it the staging of a chunk.  Per loop this counts

    instructions   SASS instructions in the body (each issues once per trip for a whole warp)
    fma            FFMA / DFMA / HFMA2: the useful work
    lds, ldg       shared and global loads; bar: barriers
    lds_vector     of the lds, the LDS.64 / LDS.128 (2 or 4 words a load: NVVM fused a thread's consecutive k)

and ``instructions / fma`` is the proxy: an H100's SM issues one instruction per scheduler per cycle, so a
latency-bound kernel with one warp per scheduler (what ncu measured for v2/v3, bench/results/gpu_h100.md)
runs about as fast as its instruction count allows.  A k loop of 4 gates x 1 row needs at least
4 FMA + 5 LDS = 2.25 instructions per FMA with scalar loads, 4 + 5/4 = 1.31 with LDS.128 (the tiles' rows
16-byte aligned: staging.pitch); index arithmetic on top of that is what this finds.

    python -m numbarnn.analysis.sass [--only NAME] [--dtype float32] [--cc 90] [--json]
                                     [--loops | --per-step [--narrow]]

``--loops`` lists every loop of each kernel, nested (the staging loops too, not only the two hot ones).

numba, the CUDA bindings and the kernel modules (which import numba) are imported inside the functions that use
them: the parser needs none of them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from shutil import which
from typing import NamedTuple

from ..cells import get_cell
from ..kernels import registry
from ..kernels.gpus import GPUS

FMA_OPS = ("FFMA", "DFMA", "HFMA2")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]*)?\b")
VECTOR_LOADS = ("LDS.64", "LDS.128")    # shared loads of 2 or 4 words (a float32 k loop's fused loads)
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")


class Loop(NamedTuple):
    """A backward branch's body: its first and last instruction index, and the count of each opcode."""

    first: int
    last: int
    ops: dict

    @property
    def instructions(self) -> int:
        return self.last - self.first + 1

    @property
    def fma(self) -> int:
        return sum(self.ops.get(op, 0) for op in FMA_OPS)

    def count(self, op: str) -> int:
        return self.ops.get(op, 0)

    def contains(self, other: Loop) -> bool:
        return self.first <= other.first and other.last <= self.last and self != other


#: what to say when nvdisasm cannot be found: the package that provides it
NVDISASM_MISSING = "nvdisasm not found: pip install 'cuda-toolkit[nvdisasm]==13.*' (numbarnn's cuda extra)"


def nvdisasm_path() -> str | None:
    """nvdisasm from the CUDA wheels (or a toolkit on PATH), None when neither has it."""
    try:
        from cuda import pathfinder  # lazy: the CUDA toolkit wheels are optional
        path = pathfinder.find_nvidia_binary_utility("nvdisasm")
        if path:
            return path
    except (ImportError, AttributeError, RuntimeError, OSError):   # pragma: no cover - older cuda-pathfinder
        pass
    return which("nvdisasm")


def cubin(ptx: str, cc: tuple) -> bytes:
    """Link PTX for sm_XY with nvJitLink (libcudadevrt too for a grid barrier, as the compile report does)."""
    from cuda.bindings import nvjitlink  # lazy: the CUDA toolkit wheels are optional

    data = ptx.encode()
    handle = nvjitlink.create(1, [f"-arch=sm_{cc[0]}{cc[1]}"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
        if "cudaCGSynchronize" in ptx:
            from numba.cuda.cudadrv.libs import get_cudalib  # lazy: numba.cuda after the simulator switch
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, get_cudalib("cudadevrt", static=True))
        nvjitlink.complete(handle)
        buf = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, buf)
        return bytes(buf)
    finally:
        nvjitlink.destroy(handle)


def disassemble(ptx: str, cc: tuple = (9, 0)) -> str:
    """The SASS of a kernel's PTX for sm_XY (nvdisasm's text)."""
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError(NVDISASM_MISSING)
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin(ptx, cc))
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def loops(sass: str) -> list[Loop]:
    """Every loop of a SASS listing (a branch to a label at or before it), in the order of their branches."""
    ops, labels, found = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = _INSTRUCTION.search(line)
        if not ins:
            continue
        op, width = ins.group(2), (ins.group(3) or "").rsplit(".", 1)[-1]
        ops.append((op, f"{op}.{width}" if op == "LDS" and width in ("64", "128") else None))
        target = _TARGET.search(line)
        if op == "BRA" and target and labels.get(target.group(1), len(ops)) < len(ops):
            first, last = labels[target.group(1)], len(ops) - 1
            counts: dict = {}
            for op_, vector in ops[first:last + 1]:
                counts[op_] = counts.get(op_, 0) + 1
                if vector:                      # counted under LDS too
                    counts[vector] = counts.get(vector, 0) + 1
            found.append(Loop(first, last, counts))
    return found


def hot_loops(sass: str) -> tuple[Loop | None, Loop | None]:
    """(inner, outer): the innermost loop with multiply-adds (the fewest instructions of those that contain
    no other such loop) and the smallest loop around it (the chunk loop), either None when absent."""
    fma_loops = [lp for lp in loops(sass) if lp.fma]
    leaves = [lp for lp in fma_loops if not any(lp.contains(o) for o in fma_loops)]
    if not leaves:
        return None, None
    inner = min(leaves, key=lambda lp: (lp.instructions, lp.first))
    around = [lp for lp in fma_loops if lp.contains(inner)]
    return inner, min(around, key=lambda lp: lp.instructions) if around else None


def summary(sass: str) -> dict:
    """{inner_instructions, inner_fma, inner_lds, inner_lds_vector, inner_per_fma, chunk_instructions,
    chunk_fma}: the hot loops of ``hot_loops`` (None where absent); inner_lds_vector counts the LDS.64/LDS.128
    among inner_lds.  chunk_* count the outer body once, its inner loop's body included once."""
    inner, outer = hot_loops(sass)
    row = dict.fromkeys(("inner_instructions", "inner_fma", "inner_lds", "inner_lds_vector", "inner_per_fma",
                         "chunk_instructions", "chunk_fma"))
    if inner is not None:
        row.update(inner_instructions=inner.instructions, inner_fma=inner.fma, inner_lds=inner.count("LDS"),
                   inner_lds_vector=sum(inner.count(v) for v in VECTOR_LOADS),
                   inner_per_fma=round(inner.instructions / inner.fma, 2))
    if outer is not None:
        row.update(chunk_instructions=outer.instructions, chunk_fma=outer.fma)
    return row


def kernel_summary(spec, cc: tuple = (9, 0)) -> dict:
    """``summary`` of a registry KernelSpec compiled for sm_XY, with its name and dtype."""
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    ptx, _ = cuda.compile_ptx(spec.pyfunc, spec.signature, cc=cc)
    return {"kernel": spec.name, "dtype": spec.dtype, "cc": f"{cc[0]}{cc[1]}", **summary(disassemble(ptx, cc))}


def per_step_v3(H: int, B: int, dtype: str = "float32", cc: tuple = (9, 0), cell: str = "lstm",
                widen: bool = True, gpu_name: str = "H100 SXM") -> dict:
    """Instructions one thread of the persistent v3 kernels issues per step in its products, at the slice
    step_v3.choose would run on `gpu_name` for H = P (no projection) and a batch of B (v3_slices.v3_co_residency:
    the widest block that helps and is co-resident; widen False: v3_slices.plan's block of THREADS):
    {"forward": {...}, "backward": {...}}, each with its TJ and threads, the rounds a
    thread runs per step (v3_slices.v3_splits: splits of K for a small batch), the SASS instructions of one round
    (its hot loops: the round loop's body once, plus the k loop's body for its other trips) and their product.
    An estimate from static counts (the epilogue and the grid barrier are not in it), as the H100 measured these
    kernels latency bound, with about one warp per scheduler (bench/results/gpu_h100.md)."""
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    from ..kernels import step_v3, v3_slices  # lazy: the kernels import numba.cuda
    from ..kernels.cell_steps import signature  # lazy: the kernels import numba.cuda

    c = get_cell(cell)
    base = v3_slices.plan(c.G, H, H, dtype, simulator=False)
    if base is None:
        raise ValueError(f"H={H}: no v3 slice fits ({dtype})")
    gpu = GPUS[gpu_name]
    out = {"H": H, "B": B}
    for phase, factory, table, ng in (("forward", step_v3.make_forward_persistent_v3, step_v3.PERSISTENT_ARGS, 1),
                                      ("backward", step_v3.make_backward_persistent_v3,
                                       step_v3.PERSISTENT_BACKWARD_ARGS, c.G)):
        sl = base
        if widen:                                       # the block step_v3.choose would run on `gpu`
            sl = v3_slices.v3_co_residency(gpu, H, H, c.G, 1, dtype, B=B, phase=phase)[0] or base
        rounds = v3_slices.v3_rounds(B, sl)
        fma_round = sl.KC * sl.RB * (c.G if phase == "forward" else 1)
        ptx, _ = cuda.compile_ptx(factory(c, dtype, sl), signature(table, c, dtype, False), cc=cc)
        inner, outer = hot_loops(disassemble(ptx, cc))
        if inner.fma >= fma_round or outer is None:     # the k loop is unrolled into the round
            per_round = inner.instructions * fma_round / inner.fma
        else:
            per_round = outer.instructions + (fma_round / inner.fma - 1) * inner.instructions
        out[phase] = {"TJ": sl.TJ, "threads": sl.threads, "rounds": ng * rounds, "per_round": round(per_round),
                      "per_step": round(per_round * ng * rounds), "fma_per_step": fma_round * ng * rounds}
    return out


def loop_rows(sass: str) -> list[dict]:
    """Every loop of a listing, outermost first where they nest: {depth, first, last, instructions, fma, lds,
    lds_vector (of those, LDS.64 and LDS.128), sts, ldg, bar}; ldg counts global loads of either form (LDG, or
    the generic LD that a pointer chosen at run time, such as R_fwd or R_rev, compiles to).  A branch to itself
    (the trap after EXIT, a spin-wait) is not a loop of the kernel's work and is left out."""
    found = sorted((lp for lp in loops(sass) if lp.instructions > 1), key=lambda lp: (lp.first, -lp.last))
    return [{"depth": sum(o.contains(lp) for o in found), "first": lp.first, "last": lp.last,
             "instructions": lp.instructions, "fma": lp.fma, "lds": lp.count("LDS"),
             "lds_vector": sum(lp.count(v) for v in VECTOR_LOADS), "sts": lp.count("STS"),
             "ldg": lp.count("LDG") + lp.count("LD"), "bar": lp.count("BAR")} for lp in found]


def format_loops(name: str, rows: list[dict]) -> str:
    keys = ("instructions", "fma", "lds", "lds_vector", "sts", "ldg", "bar")
    lines = [f"{name}: " + ("no loops" if not rows else "loops (instructions of one trip of each body)")]
    lines += ["  " + "  " * r["depth"] + f"[{r['first']}..{r['last']}] " + " ".join(f"{k} {r[k]}" for k in keys)
              for r in rows]
    return "\n".join(lines)


def format_rows(rows: list[dict]) -> str:
    head = ("kernel", "dtype", "cc", "k loop: instr", "fma", "lds", "vector", "instr/fma", "chunk loop: instr",
            "fma")
    keys = ("kernel", "dtype", "cc", "inner_instructions", "inner_fma", "inner_lds", "inner_lds_vector",
            "inner_per_fma", "chunk_instructions", "chunk_fma")
    table = [head] + [tuple("-" if r.get(k) is None else str(r[k]) for k in keys) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbarnn.analysis.sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="_v3", help="kernels whose name contains this (default: _v3)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cc", default="90", help="compute capability, e.g. 80 or 90")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--loops", action="store_true",
                   help="every loop of each kernel, nested, with its counts (not only the two hot ones)")
    p.add_argument("--per-step", action="store_true",
                   help="instructions per step and thread of v3's products at the DeepBench shapes (per_step_v3)")
    p.add_argument("--narrow", action="store_true",
                   help="with --per-step: v3_slices.plan's blocks (THREADS threads), not the widest co-resident")
    args = p.parse_args(argv)
    from numba import config  # lazy: numba after the simulator switch
    if config.ENABLE_CUDASIM:
        print("python -m numbarnn.analysis.sass: needs numba without NUMBA_ENABLE_CUDASIM", file=sys.stderr)
        return 2
    if nvdisasm_path() is None:
        print(f"python -m numbarnn.analysis.sass: {NVDISASM_MISSING}", file=sys.stderr)
        return 2
    cc = (int(args.cc[0]), int(args.cc[1]))
    if args.per_step:
        rows = [per_step_v3(H, B, args.dtype, cc, widen=not args.narrow)
                for H, B in ((768, 16), (256, 4), (512, 32), (1024, 64))]
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            from ..kernels import v3_slices  # lazy: the kernels import numba.cuda
            block = f"{v3_slices.THREADS} threads a block" if args.narrow else "the blocks step_v3.choose runs on an H100"
            print(f"v3 products, instructions per step and thread ({args.dtype}, sm_{args.cc}, {block}; SASS loop "
                  f"counts x trips, an estimate):")
            for r in rows:
                print(f"  H={r['H']:<5} B={r['B']:<3} " + "  ".join(
                    f"{ph} TJ={r[ph]['TJ']} x {r[ph]['threads']} threads {r[ph]['per_step']:>7} "
                    f"({r[ph]['rounds']} rounds x {r[ph]['per_round']})" for ph in ("forward", "backward")))
        return 0
    specs = [s for s in registry.all_specs() if args.only in s.name and s.dtype == args.dtype]
    if not specs:
        print(f"no {args.dtype} kernel name contains {args.only!r}", file=sys.stderr)
        return 2
    if args.loops:
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        found = {}
        for spec in specs:
            ptx, _ = cuda.compile_ptx(spec.pyfunc, spec.signature, cc=cc)
            found[spec.name] = loop_rows(disassemble(ptx, cc))
        print(json.dumps(found, indent=1) if args.json else "\n".join(format_loops(n, r) for n, r in found.items()))
        return 0
    rows = [kernel_summary(s, cc) for s in specs]
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile time: numba-cuda's copy of an inlined device function's IR, made once per call instead of per block.

numbarnn's kernels call their device functions with ``inline="always"`` (common.py says why), so numba inlines
them at the IR level: ``InlineWorker.inline_ir`` (numba-cuda 0.30, ``numba/cuda/core/inline_closurecall.py``)
copies the callee's IR before mutating it, twice per call site, one block at a time::

    kernel_copy.blocks = {
        block_label: copy.deepcopy(block)
        for block_label, block in the_ir.blocks.items()
    }

Every ``Var`` in a block points at the function's ``Scope``, which holds every variable of the function, and
each block gets a fresh deepcopy memo: each block copies the whole scope again, so one copy costs blocks x
variables.  The step bodies numbarnn inlines are large (unrolled k loops, the cell), and this copy took ~70% of
``cuda.compile_ptx`` for the persistent v3 kernels (cProfile: 18 of 26 s, 3 million deepcopy calls).  Copying
the blocks in one deepcopy (one memo) copies the scope once and each block once::

    kernel_copy.blocks = copy.deepcopy(the_ir.blocks)

The copy has the same blocks, statements and variables; only the per-block duplicates of the scope are gone,
which inline_ir never told apart (it asserts the callee has one scope, comparing them by value, and points the
inlined blocks at the caller's scope).  Upstream: NVIDIA/numba-cuda issue #688 (PR #689, open, removes the
second copy instead).

``install()`` replaces ``InlineWorker.inline_ir`` by its own source with that one statement changed, only where
the installed numba-cuda's source contains the statement exactly as above (else it changes nothing and says
so in what it returns).  It changes numba-cuda for the whole process (every kernel compiled in it, numbarnn's
or not); NUMBARNN_INLINE_COPY=0 leaves numba-cuda as it is.  Checked by ``tests/test_inline_copy.py``: the PTX of numbarnn's kernels is byte-identical
with and without it; measured by ``python -m numbarnn.kernels.inline_copy`` (compile_ptx times, both ways).
"""
from __future__ import annotations

import hashlib
import inspect
import os
import sys
import textwrap
import time

PER_BLOCK = """\
        kernel_copy.blocks = {
            block_label: copy.deepcopy(block)
            for block_label, block in the_ir.blocks.items()
        }"""
ONE_COPY = """\
        kernel_copy.blocks = copy.deepcopy(the_ir.blocks)"""
SWITCH = "NUMBARNN_INLINE_COPY"

def install() -> str:
    """Replace numba-cuda's InlineWorker.inline_ir by the one-copy version (once per process: the replacement
    carries the original, so this works however often this module is imported); returns what happened."""
    if os.environ.get(SWITCH, "1").strip() == "0":
        return f"not installed: {SWITCH}=0"
    try:
        from numba.cuda.core import inline_closurecall as icc
        original = icc.InlineWorker.inline_ir
        if getattr(original, "numba_inline_ir", None) is not None:
            return "installed"
        source = textwrap.dedent(inspect.getsource(original))
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        return f"not installed: {type(exc).__name__}: {exc}"
    if source.count(PER_BLOCK) != 1:
        return "not installed: this numba-cuda's inline_ir has no per-block copy"
    namespace: dict = {}
    exec(compile(source.replace(PER_BLOCK, ONE_COPY), icc.__file__, "exec"), vars(icc), namespace)  # noqa: S102
    fixed = namespace["inline_ir"]
    fixed.__doc__, fixed.__qualname__ = original.__doc__, original.__qualname__
    fixed.numba_inline_ir = original
    icc.InlineWorker.inline_ir = fixed
    return "installed"


def installed() -> bool:
    from numba.cuda.core import inline_closurecall as icc
    return getattr(icc.InlineWorker.inline_ir, "numba_inline_ir", None) is not None


def uninstall() -> None:
    """Put numba-cuda's own inline_ir back (for comparisons)."""
    from numba.cuda.core import inline_closurecall as icc
    original = getattr(icc.InlineWorker.inline_ir, "numba_inline_ir", None)
    if original is not None:
        icc.InlineWorker.inline_ir = original


def ptx_digests(names=None, dtypes=("float32",)) -> dict:
    """{(kernel, dtype): (sha1 of its sm_80 PTX, seconds)} for the registered kernels (all names, or those
    given), compiled with the inline_ir in place now.  Needs numba outside the simulator (no GPU)."""
    from numba import cuda

    from . import registry
    specs, _ = registry.load_specs()
    out = {}
    for spec in specs:
        if spec.dtype not in dtypes or (names is not None and spec.name not in names):
            continue
        start = time.perf_counter()
        ptx, _ = cuda.compile_ptx(spec.pyfunc, spec.signature, cc=(8, 0))
        out[(spec.name, spec.dtype)] = (hashlib.sha1(ptx.encode()).hexdigest(), time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    """python -m numbarnn.kernels.inline_copy [--with | --without] [NAME ...]: compile_ptx time and PTX digest
    of each kernel (float32), with numba-cuda's inline_ir or the one-copy one.  Compare two runs' digests."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "--with"
    if argv and argv[0] in ("--with", "--without"):
        mode = argv.pop(0)
    from . import registry
    registry.load_specs()                    # imports the kernel modules, whose common.py installs it
    if mode == "--without":
        uninstall()
    else:
        print(f"inline_copy: {install()}", file=sys.stderr)
    assert installed() == (mode == "--with")
    total = 0.0
    for (name, dtype), (digest, seconds) in ptx_digests(argv or None).items():
        total += seconds
        print(f"{name} {dtype} {digest} {seconds:.2f}")
    print(f"total {total:.1f} s ({mode[2:]} the one-copy inline_ir)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

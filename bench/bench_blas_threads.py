"""What NumPy's BLAS (OpenBLAS) does to the threads around it, on this machine: the measurements behind the cpu
backend's rules for row groups after a BLAS product (fused.row_groups) and its weight gradients staying BLAS's.

1. A parallel numba loop (2 row-group-like halves) idle, and right after a float32 [800, 1024] x [1024, 512]
   product: OpenBLAS's worker threads spin after a product and take the loop's second core.
2. That product whole on BLAS's own threads, whole on one thread, and in two row pieces on one-thread BLAS run
   from two Python threads (does OpenBLAS let two single-thread calls overlap?).

    python bench/bench_blas_threads.py [rounds, default 15]

Prints medians in ms; validates the pieces' product against the whole first.
"""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit, prange
from threadpoolctl import threadpool_info, threadpool_limits

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 15


@njit(parallel=True)
def halves(a, n):
    """Two independent halves of scalar work, one per thread (like two row groups)."""
    s = np.zeros(2)
    for g in prange(2):
        acc = 0.0
        for i in range(n):
            acc += np.sin(a[i % a.shape[0]] + g)
        s[g] = acc
    return s


def median_ms(fn, before=None, pause=0.25):
    times = []
    for _ in range(ROUNDS):
        time.sleep(pause)                      # OpenBLAS's threads sleep again after ~0.1 s
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return np.median(times) * 1e3


def main():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((800, 1024)).astype(np.float32)     # [T*B, G*H] (a backward's dgx)
    W = rng.standard_normal((1024, 512)).astype(np.float32)     # [G*H, I]
    out = np.empty((800, 512), np.float32)
    a = rng.random(1000)
    halves(a, 10)
    helper = ThreadPoolExecutor(1)

    def pieces():
        with threadpool_limits(1, user_api="blas"):
            later = helper.submit(np.matmul, A[400:], W, out=out[400:])
            np.matmul(A[:400], W, out=out[:400])
            later.result()

    def one_thread():
        with threadpool_limits(1, user_api="blas"):
            np.matmul(A, W, out=out)

    pieces()
    assert np.allclose(out, A @ W, rtol=1e-4, atol=1e-3), "the pieces' product is wrong"
    blas = [(i["internal_api"], i["version"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"]
    print(f"numba {numba.__version__} ({numba.threading_layer()} layer, {numba.get_num_threads()} threads), "
          f"BLAS {blas}; medians of {ROUNDS}, ms")
    loop = lambda: halves(a, 3_000_000)                         # noqa: E731
    print(f"parallel loop: idle {median_ms(loop):.1f}, right after the product {median_ms(loop, lambda: A @ W):.1f}")
    print(f"product: BLAS's threads {median_ms(lambda: np.matmul(A, W, out=out), pause=0.05):.2f}, one thread "
          f"{median_ms(one_thread, pause=0.05):.2f}, two pieces on one-thread BLAS from two Python threads "
          f"{median_ms(pieces, pause=0.05):.2f}")


if __name__ == "__main__":
    main()

"""The "cpu" backend: fused numba time loops for every step, BLAS for the big products.

Per layer l and direction d (the reference's structure, `numbarnn/reference/network.py`, without its float64
copies and per-step fancy indexing), `fused.py`:

    forward:  one njit call: per step, per unit tile and tile of rows, W x_t and R h by an LLVM-IR
              micro-kernel (register-blocked fused multiply-adds), then the cell's own pointwise forward
              (bias added there), writing c, h, y and the reserve; with a projection h' = W_proj m per row
              tile by the same micro-kernel after the step's units; no BLAS, no Python per step
    backward: one njit call: per step (projection: dm = W_proj^T (dy + dh) by the micro-kernel) the njit
              pointwise backward writes dgx [t, b] and dgh [s, b], then dh += dgh_s R by the micro-kernel;
              after the loops dW, dR, dW_proj and dx as single BLAS matmuls

`NUMBARNN_CPU_FUSED=0` (or `settings.override(cpu_fused=False)`) runs the BLAS loops instead (the design before
the fused loops; tests and bench/bench_cpu_fused.py compare the two):

    gx = x_l @ W^T                        one BLAS matmul over all T steps        [T, B, G*H]
    for step s = 0 .. T-1:
        gh^T = R @ h^T                    one BLAS matmul for all B rows          [G*H, B]  (np.matmul out=;
                                          on OpenBLAS faster than h @ R^T into [B, G*H])
        forward_step(...)                 njit: for active rows (s < len[b]) and every unit j, the cell's own
                                          pointwise `forward` (bias added here), writes c, h, y and the reserve;
                                          vectorized over units (chunks through stack scratch, see cells.py)
        (projection: h' = m @ W_proj^T by BLAS, then `commit_projection` for the active rows)
    backward mirrors it: per step (W_proj^T (dy + dh) by BLAS,) the njit pointwise backward, dh += dgh_s @ R
    (BLAS); after the loop dW, dR, dW_proj, dx as single big matmuls.

Rows past their length carry their state (the njit loops skip them) and their outputs stay 0; no row is ever
copied or gathered (the fused loops visit rows longest first through an index).  Nothing is allocated per step; scratch (W x_t for all steps, the backward's dgx, dgh, ...,
and the whole reserve-shaped buffer of an inference call) comes from a per-thread workspace kept across calls
(`workspace.py`: a fresh 26 MB array costs tens of ms of page faults here, reused memory nothing); only what a
call returns is allocated per call.  `numbarnn.cpu.workspace.release()` frees the scratch.  Calls of few rows
(T*B <= 256: a loop over single steps) also keep the fused forward's packed weights with the bits they were
packed from, and pack again only when the weights differ (`panels.py`: at T*B = 1 packing was most of a call).

Compute dtype: float64 for float64, float32 for float32 and float16 (float16 inputs are converted once on the
way in, results once on the way out; the reserve is stored in the call's dtype, as ops.py expects).

Threads: the fused loops split the batch rows over the caller's count of threads (``numba.set_num_threads(n)``
at run time or NUMBA_NUM_THREADS before import; default: all cores; in numbarnn.torch torch's count), each
thread its own time loop (`fused.row_groups`), for calls of 2^24 multiply-adds or more (smaller calls run on one
thread).  The threads are numbarnn's own (`threads.team`: the caller's and helpers idle on a lock), not numba's
parallel loops: libgomp's workers spin for milliseconds after a parallel region, OpenBLAS's ~0.1 s after a
product, each on the core the next pool wants.  The fused backward's weight gradients run in slices on the same
threads, one BLAS thread each.  The BLAS loops use BLAS's pool (OpenBLAS: OPENBLAS_NUM_THREADS / threadpoolctl,
within the call's count); their njit steps run in parallel over rows only for very wide steps
(B*H >= cells.PARALLEL_MIN_WORK).
On a machine whose cores are busy with other processes, OpenBLAS's threads make every per-step product wait
for a descheduled thread: measured (2 cores, load ~3.5) examples/char_lstm.py 40-46 ms per training step
with OPENBLAS_NUM_THREADS=1, 200-237 ms with 2 (the reference backend: 67 and 406 ms).  Set
OPENBLAS_NUM_THREADS=1 there, or for small models.

Compile: every njit function is cached on disk (numba ``cache=True``; the per-cell step loops and the fused
loops too, keyed by a fingerprint of the cell's code and of the library's sources, `cells.variant_key`), so only
the first process after an install or a change compiles (seconds); later processes load the machine code.
numba alone invalidates a cached function only when its own file changes: an edit to a helper in another file
would otherwise keep running the old machine code (tests/test_cpu_backend.py checks it does not).  Processes
compiling at the same time (test workers, DDP ranks on a cold cache) share the cache safely: numba's own
index + data files race there (numba issue #4807), `jitcache.py` locks them.

Modules: `fused.py` (the fused loops and their micro-kernel), `jitcache.py` (numba's disk cache, locked), `cells.py` (njit twins of the cell helpers,
per-cell step loops), `network.py` (the layer/direction/step driver), `block_lstm.py` (BlockLSTM V1/V2 and grads), `philox.py` (dropout masks: the CUDA kernels'
Philox device functions compiled for the CPU), `backend.py` (the backend contract), `workspace.py` (scratch
kept across calls), `panels.py` (packed weights kept between small calls), `modulated.py` and `diagonal.py` (the
BLAS loops' products of modulated and diagonal cells), `threads.py` (one thread budget), `tuning.py` (tile
shapes measured per machine).
"""

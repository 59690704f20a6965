"""numba.cuda kernels and their runtime: the cuda backend.

A call goes ops -> backend.py (device arrays, layouts) -> driver.py.  For one call, plan.py first builds the list
of launches it will make, as data (a `Launch` per kernel: factory and key, grid, block, arguments by role, the
steps it covers, why this step version, FLOP/byte estimates), in the order of reference/network.py's loops; the
driver allocates the buffers it names and runs the list; launch.py makes each launch (numba's, typed and packed
once per argument kind).  `launch_plan` (numbarnn explain, the profiler, the roofline model) reads the same plan.
What the kernels are planned for is explicit: target.py (the simulator or a GPU, scoped with `planning_for`),
gpus.py (the GPUs' figures and per-SM limits), settings (NUMBARNN_* read in one place).

    plan               plan.py (a call's launches as data), steps.py (which step version runs, `step_plan`, and
                       each version's launches: one row of STEP_KERNELS), driver.py (runs a plan)
    per call           gemm.py (v1..v4 side by side, split-K), layer_ops.py (dropout, column sums, tiling),
                       philox.py (dropout masks), cast and fill helpers in common.py
    per step, v1       cell_steps.py (one thread per row and unit) + recurrent.py (dh = dgh R); modulated.py
    per step, v2       step_v2.py: a tiled product reads R once per step for all rows, the cell in its epilogue
    per layer, v3      step_v3.py: one persistent cooperative launch per layer, R's slice in shared memory for
                       all steps, a grid barrier per step (v3_slices.py: what a block holds; v3_parts.py: its
                       device functions)
    shared             epilogues.py (the cell's pointwise math after a product), staging.py (shared-memory
                       staging), common.py (dtypes, `device`, `jit`), simulator.py (fixes to numba's simulator)
    block_lstm.py      TensorFlow's BlockLSTM ops
    registry.py        every kernel specialisation, for the compile report (numbarnn.analysis.report)

How to add a step version v4: a module step_v4.py with its kernel factories (`make_forward_step_v4`, ...;
specialised per cell and dtype, the cell's math from epilogues.py) and `kernel_specs()` for the compile report;
in steps.py one row `4: StepKernels(4, title, v4_forward, v4_backward)`, whose functions append the version's
launches for a layer to the plan (kernel factory and key, grid, block, argument roles, the step range, estimates),
and `step_plan` says when v4 runs (its note: why, and its fallback).  The driver runs those entries and
`numbarnn explain` lists them with no other change; the profiler's `PROFILED_STEP_VERSIONS` names it; tests run it
in the simulator on grids of several blocks with a partial last block (tests/conftest.py's planned_and_launched
checks that the plan executed is the plan listed and that the launches counted are its launches).
"""
import numpy as np

# numba-cuda 0.30.4 registers an overload of np.row_stack for every NumPy >= 2.0 (numba itself stops at 2.5),
# and NumPy 2.5 removed it: the first kernel compiled on a real GPU then fails with AttributeError
# ("module 'numpy' has no attribute 'row_stack'").  Seen on a lent H100 (numpy 2.5.2, numba-cuda 0.30.4).
# np.row_stack was an alias of np.vstack; restoring the alias lets numba-cuda's registry load.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

# numbarnn's fixes to numba's CUDA simulator (numbarnn/kernels/simulator.py) are installed by common.py, which
# every kernel module imports: not here, because a command may import this package (for its argument parser)
# before it switches the simulator on (`numbarnn profile` did, and ran without the fixes).

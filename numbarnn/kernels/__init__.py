"""numba.cuda kernels (see docs and each module's docstring)."""
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

"""numba.cuda kernels (see docs and each module's docstring)."""
import os

import numpy as np

# numba-cuda 0.30.4 registers an overload of np.row_stack for every NumPy >= 2.0 (numba itself stops at 2.5),
# and NumPy 2.5 removed it: the first kernel compiled on a real GPU then fails with AttributeError
# ("module 'numpy' has no attribute 'row_stack'").  Seen on a lent H100 (numpy 2.5.2, numba-cuda 0.30.4).
# np.row_stack was an alias of np.vstack; restoring the alias lets numba-cuda's registry load.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

# numba's CUDA simulator hands the threads of a block their static shared arrays without a lock: rarely, two
# threads get different arrays and a kernel's result is silently wrong.  numbarnn/kernels/simulator.py.
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    from .simulator import install as _install_simulator_fix
    _install_simulator_fix()

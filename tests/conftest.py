"""Test set-up: kernels run in numba's CUDA simulator unless a real GPU is requested.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported (later it silently does nothing),
which is why it happens here, at collection time, before any test module imports numbarnn.
Set NUMBARNN_REAL_GPU=1 to run the same tests on a real GPU.
"""
import os

if os.environ.get("NUMBARNN_REAL_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from hypothesis import HealthCheck, settings  # noqa: E402

# Simulator runs are slow and their time varies: no deadlines; a small, deterministic default budget
# (CI runs on 2 cores in well under 15 minutes). NUMBARNN_HYPOTHESIS_PROFILE=thorough for more examples.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("NUMBARNN_HYPOTHESIS_PROFILE", "ci"))

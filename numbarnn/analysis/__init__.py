"""Tools that measure and model the kernels, without a GPU: the memory profiler that runs them in numba's CUDA
simulator (profiler), the roofline model of their time (roofline), the compile report of registers, spills and
occupancy (report) and the SASS of their hot loops (sass).

The kernels never import this package: what both sides need (the GPUs' figures, the per-SM limits and the
occupancy arithmetic) is numbarnn.kernels.gpus, and step_v3's co-residency estimate is step_v3's own.
"""

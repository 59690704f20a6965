"""numbarnn: cuDNN's RNN ops and TensorFlow's BlockLSTM ops as numba.cuda kernels, checked against NumPy."""
__version__ = "0.1.0"

# CUDA sources of cupy_rmsnorm, installed as the package data cupy_rmsnorm/kernels.

"""CuPy kernels (CUDA C inside RawModules), each with a NumPy reference used when no GPU is present."""

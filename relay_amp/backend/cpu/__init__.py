"""The CPU backend: default schedules, AVX-512 and AMX dot-product kernels, fast math, kernel dispatch, and the
pipeline that chains them."""

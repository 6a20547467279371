"""Numba CUDA kernels of the grouped block-scaled matmul.

``simt``: the plain SIMT kernel (no inline PTX), every format, any legal config; it also runs in
Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, chosen when numba is first imported).
"""

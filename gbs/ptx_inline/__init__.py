"""Numba intrinsics that emit inline PTX, one module per instruction family.

Each intrinsic is a thin, documented wrapper of one PTX instruction form; kernels compose them.
``offline`` compiles kernels for a target without a GPU (sm_90a, sm_100a) and reads their SASS,
which is how CI proves that every family assembles to the instructions it promises.
"""

"""Numba CUDA kernels of the grouped block-scaled matmul.

``simt``: the plain SIMT kernel (no inline PTX), every format, any legal config; it also runs in
Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, chosen when numba is first imported).
``h200_stream``: the H200 (sm_90a) kernel: TMA ring of K slices, software block scales,
``mma.sync`` bf16, cta_group 2 as a 2-CTA cluster with TMA multicast of the token tile.
``sm100``: the Blackwell (sm_100a) tcgen05 kernel, assembled in CI; it needs a B200-class GPU.
``launch``: compile / dynamic shared memory / cluster launch / tensor-map helpers they share.
``relayout``: FP4 bytes and UE4M3 scales into ``gbs.formats.E2M1H200Order`` on the GPU (tokens for
``a_layout="e2m1_h200"``).
"""

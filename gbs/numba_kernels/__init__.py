"""Numba CUDA kernels of the grouped block-scaled matmul. Kernels take a resolved build (a spec) and never plan:
what runs on an H200 is decided by ``gbs.plan``, what runs on SM100 by ``gbs.dispatch``.

H200 (sm_90a), one TMA ring and two consumers:

* ``h200_ring``: the shared ring (``StreamSpec``, shared-memory layout, the producer's tile walk, work records,
  split-K walk, 2-CTA multicast);
* ``h200_decode``: the exact software block-scale decode of FP4 / FP8 elements into bf16;
* ``h200_stream``: the streaming consumer (``mma.sync`` bf16), for decode and small prefill;
* ``h200_wgmma``: the ``wgmma`` consumer (``WgmmaSpec``), for prefill (and swapped, small prefill);
* ``h200_trace``: the start-up trace, a compile-time diagnostic build;
* ``h200_launch``: the launch layer both share: checks, stage and residency questions, tensor maps, workspace,
  ``prepare(plan)``.

SM100 (sm_100a, assembled in CI, never run here): ``sm100_spec`` (the build and its shared / tensor memory),
``sm100_addressing`` (TMA coordinates, descriptors), ``sm100_kernel`` (the tcgen05 kernel), ``sm100_build``
(offline builds), ``sm100`` (host: checks, launch).

``simt``: the plain SIMT kernel (no inline PTX), every format, any legal config; it also runs in Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``). ``launch``: compile / dynamic shared memory / cluster launch / tensor-map
helpers. ``relayout``: FP4 bytes and UE4M3 scales into ``gbs.layouts.E2M1H200Order`` on the GPU.
"""

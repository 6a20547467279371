"""One-off (session 13): the fixed cost of a streaming-kernel launch, timed like the bench."""
import numpy as np
from numba import cuda
from gbs import bench
from gbs.api import h200_kernel
from gbs.numba_kernels import h200_stream
from gbs.numba_kernels.launch import to_device

@cuda.jit
def empty(x):
    if cuda.threadIdx.x == 1024:
        x[0] = 1

x = cuda.device_array(1, np.int32)
t = bench.time_launches(lambda i: empty[132, 160](x), budget_s=0.5)
print(f"empty kernel 132 x 160: {t.median_us:.1f} us")
for label, ids in (("Kimi, every slot -1 (no tiles)", [-1] * 8), ("Kimi, 1 expert of 8 live", [0] + [-1] * 7),
                   ("Kimi (8 experts)", list(range(8)))):
    p = bench.synthetic_problem("nvfp4", n=512, k=7168, group_sizes=[1] * 8, expert_ids=ids, num_experts=8, seed=1)
    p = p.with_b_layout("e2m1_h200")
    kernel, knobs = h200_kernel(bench.synthetic_problem("nvfp4", n=512, k=7168, group_sizes=[1] * 8,
                                                        expert_ids=list(range(8)), num_experts=8, seed=1))
    copies = 8
    launches = [h200_stream.prepare(to_device(p), knobs) for _ in range(copies)]
    t = bench.time_launches(lambda i: launches[i](), num_inputs=copies, budget_s=0.5)
    print(f"{label:34}: {t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f}), ctas {launches[0].num_ctas}, "
          f"splits {launches[0].k_splits}")

"""One-off (session 13): no-work launches (every slot -1) of several kernels, timed like the bench."""
from gbs import bench
from gbs.numba_kernels import h200_stream, h200_wgmma
from gbs.numba_kernels.h200_stream import StreamConfig
from gbs.numba_kernels.launch import to_device

def timed(label, problem, prepare):
    launches = [prepare(to_device(problem)) for _ in range(4)]
    t = bench.time_launches(lambda i: launches[i](), num_inputs=4, budget_s=0.3)
    print(f"{label:52}: {t.median_us:.1f} us, ctas {launches[0].num_ctas}", flush=True)

for fmt, n, k in (("nvfp4", 512, 7168), ("mxfp8", 512, 7168)):
    skipped = bench.synthetic_problem(fmt, n=n, k=k, group_sizes=[1] * 8, expert_ids=[-1] * 8, num_experts=8, seed=1)
    timed(f"{fmt} stream swap bn8 st2, no tiles", skipped, lambda d: h200_stream.prepare(d, StreamConfig(True, 8, 1, 2), k_splits=4))
    timed(f"{fmt} stream swap bn8 st2 unsplit, no tiles", skipped, lambda d: h200_stream.prepare(d, StreamConfig(True, 8, 1, 2), k_splits=1))
    timed(f"{fmt} stream noswap bn128 st2, no tiles", skipped, lambda d: h200_stream.prepare(d, StreamConfig(False, 128, 1, 2), k_splits=1))
    timed(f"{fmt} wgmma bn128, no tiles", skipped, lambda d: h200_wgmma.prepare(d, h200_wgmma.WgmmaConfig(128)))
skipped = bench.synthetic_problem("mxfp8", n=512, k=7168, group_sizes=[1] * 8, expert_ids=[-1] * 8, num_experts=8, seed=1)
timed("mxfp8 wgmma e4m3 bn128, no tiles", skipped, lambda d: h200_wgmma.prepare(d, h200_wgmma.WgmmaConfig(128, mma_operands="e4m3")))

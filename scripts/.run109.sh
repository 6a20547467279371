set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gbs_site .whl/*.whl
export PYTHONPATH=/tmp/gbs_site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 GBS_COMMIT=$(git rev-parse --short HEAD)
nvidia-smi --query-gpu=name,serial,uuid --format=csv
echo "== 1. GPU tests: auto plan"
timeout 150 python3 -m pytest -m gpu tests/test_h200_wgmma.py -k "auto_backend" -q -p no:cacheprovider 2>&1 | tail -3
echo "== 2. bench small prefill"
timeout 150 python3 -m gbs bench --skip-peaks --formats nvfp4,mxfp4 --shapes small_prefill_up \
  --backends gbs_auto_h200_fused,torch_bf16,torch_fp8_rowwise,copy --csv $OUT/bench-run109.csv 2>&1 | grep -v Warning | tail -14
echo "== 3. the streaming / swapped crossover: 24 and 28 tokens"
timeout 120 python3 scripts/h200_stream_sweep.py --budget-s 0.2 --b-layout e2m1_h200_fused --a-layout e2m1_h200 --csv $OUT/sweep.csv \
  plan:h200_stream:nvfp4:4096,7168,32,24 wgmma:nvfp4:4096,7168,32,24:32:auto:swap plan:h200_stream:nvfp4:4096,7168,32,28 wgmma:nvfp4:4096,7168,32,28:32:auto:swap \
  plan:h200_stream:mxfp4:4096,7168,32,24 wgmma:mxfp4:4096,7168,32,24:32:auto:swap 2>&1 | grep -v Warning | tail -8
echo "== 4. memcheck, swapped tiles"
timeout 200 compute-sanitizer --tool memcheck python3 scripts/sanitize_small.py h200_wgmma swapped nvfp4 2>&1 | tail -6

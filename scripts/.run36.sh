set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gbs_site .whl/*.whl
export PYTHONPATH=/tmp/gbs_site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 GBS_COMMIT=61a349f
timeout 500 python3 -m gbs bench --backends gbs_auto,gbs_auto_h200_layout,torch_bf16,torch_fp8_rowwise,copy --csv $OUT/bench.csv > $OUT/bench.log 2>&1
echo "rc=$?"; tail -45 $OUT/bench.log

set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gbs_site .whl/*.whl
export PYTHONPATH=/tmp/gbs_site:$PWD PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 GBS_COMMIT=61a349f
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 400 $CS --tool memcheck python3 scripts/sanitize_small.py h200_stream h200_wgmma > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?" >> $OUT/memcheck.log ) &
( timeout 400 $CS --tool racecheck python3 scripts/sanitize_small.py h200_stream > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?" >> $OUT/racecheck.log ) &
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_h200_stream.py tests/test_h200_wgmma.py \
  -k "mxfp4 or mxfp8 or w4a8 or e5m2 or resources or real_data" 2>&1 | tail -15 | tee $OUT/gpu_tests.log
wait
tail -4 $OUT/memcheck.log; tail -4 $OUT/racecheck.log

#!/usr/bin/env bash
# GPU runner: on a machine with a CUDA GPU, run the GPU-marked tests and the short benchmark, and write
# logs / CSV under $OUT (default ./gpu_out).
#
#   scripts/gpu_run.sh            # tests + benchmark
#   scripts/gpu_run.sh tests      # GPU tests only
#   scripts/gpu_run.sh bench      # benchmark only
#
# Python packages: your own environment (`make venv`, then PYTHON=.venv/bin/python), or, on the project's H200
# image (numba-cuda 0.30.4 with numpy 2.5, which it cannot import), the wheels carried in .whl/ (numpy 2.4,
# ml_dtypes), installed into a private target directory. Fetch them once with `scripts/fetch_gpu_wheels.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
what=${1:-all}

if compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/gbs_site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import sys, numpy, numba, numba_cuda, ml_dtypes; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'ml_dtypes', ml_dtypes.__version__)"
  echo "commit ${GBS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; } 2>&1 | tee "$OUT/env.txt"

rc=0
if [ "$what" = all ] || [ "$what" = tests ]; then
    # notebooks run in CI (their harness, nbclient, is not on GPU images and they need no GPU)
    "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --ignore=tests/test_notebooks.py \
        --junitxml="$OUT/gpu_tests.xml" tests 2>&1 | tee "$OUT/gpu_tests.log"
    rc=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    "$PY" -m gbs bench --quick --csv "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log"
    brc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && rc=$brc
fi
exit "$rc"

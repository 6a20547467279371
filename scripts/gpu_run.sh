#!/usr/bin/env bash
# GPU runner: on a machine with a CUDA GPU, run the GPU-marked tests, compute-sanitizer on small cases of every
# kernel variant, and the benchmark, and write logs / CSV under $OUT (default ./gpu_out).
#
#   scripts/gpu_run.sh            # tests + benchmark (--quick)
#   scripts/gpu_run.sh tests      # GPU tests only
#   scripts/gpu_run.sh sanitize   # compute-sanitizer memcheck + racecheck of scripts/sanitize_small.py
#   scripts/gpu_run.sh bench      # benchmark only; BENCH_ARGS replaces --quick (e.g. BENCH_ARGS="--skip-peaks")
#   scripts/gpu_run.sh verify     # tests and sanitize side by side (separate processes), then nothing else
#   scripts/gpu_run.sh probe      # the FP8 route's probes: scripts/wgmma_fp8_probe.py, scripts/fp8_route_probe.py
#
# Records kept under $OUT for each mode (so a claim can cite the test that backs it): tests -> gpu_tests-<mode>.xml
# (JUnit, one testcase per test id) and gpu_tests-<mode>.log (-rap: a PASSED / FAILED / SKIPPED line per test id);
# sanitize -> sanitize-<tool>-<kernel>.xml (JUnit, one testcase per case of scripts/sanitize_small.py) and .log,
# and sanitize-summary.txt (one PASS / FAIL line per tool and kernel with compute-sanitizer's summary).
#
# GPU tests run in GBS_TEST_WORKERS pytest-xdist workers where pytest-xdist is installed (default 8: the
# workers' time is mostly Numba / ptxas compiles, which are per process; correctness only, nothing is timed).
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

{ nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import sys, numpy, numba, numba_cuda, ml_dtypes; print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'ml_dtypes', ml_dtypes.__version__)"
  echo "commit ${GBS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; } 2>&1 | tee "$OUT/env.txt"

run_tests() {
    local workers=()
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n "${GBS_TEST_WORKERS:-8}")
    # notebooks run in CI (their harness, nbclient, is not on GPU images and they need no GPU)
    # -rap: every test id with its outcome in the log (no captured output), beside the JUnit XML; sm100 tests skip
    # off Blackwell
    "$PY" -m pytest -q -m gpu -rap -p no:cacheprovider "${workers[@]}" --ignore=tests/test_notebooks.py \
        --junitxml="$OUT/gpu_tests-$what.xml" tests > "$OUT/gpu_tests-$what.log" 2>&1
}

# one process per (tool, kernel): each compiles only its own kernel's builds
run_sanitize() {
    local pids=() names=() tool kernel rc=0
    for tool in memcheck racecheck; do
        for kernel in h200_stream h200_wgmma simt; do
            compute-sanitizer --tool "$tool" --error-exitcode 1 "$PY" scripts/sanitize_small.py "$kernel" \
                --junitxml "$OUT/sanitize-$tool-$kernel.xml" > "$OUT/sanitize-$tool-$kernel.log" 2>&1 &
            pids+=($!)
            names+=("$tool $kernel")
        done
    done
    : > "$OUT/sanitize-summary.txt"
    for i in "${!pids[@]}"; do
        local verdict=PASS log="$OUT/sanitize-${names[$i]// /-}.log"
        wait "${pids[$i]}" || { verdict=FAIL; rc=1; }
        echo "$verdict ${names[$i]}: $(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|failed$" "$log" | tr '\n' ' ')" \
            >> "$OUT/sanitize-summary.txt"
    done
    cat "$OUT/sanitize-summary.txt"
    return $rc
}

rc=0
case "$what" in
    all|tests) run_tests; rc=$?; tail -4 "$OUT/gpu_tests-$what.log" ;;
    sanitize) run_sanitize; rc=$? ;;
    verify)
        run_tests & tests_pid=$!
        run_sanitize; rc=$?
        wait "$tests_pid" || rc=1
        tail -4 "$OUT/gpu_tests-$what.log" ;;
    bench) ;;
    probe) "$PY" scripts/wgmma_fp8_probe.py --csv "$OUT/wgmma_fp8_probe.csv" 2>&1 | tee "$OUT/wgmma_fp8_probe.log"
           rc=${PIPESTATUS[0]}
           "$PY" scripts/fp8_route_probe.py --csv "$OUT/fp8_route_probe.csv" 2>&1 | tee "$OUT/fp8_route_probe.log"
           [ "$rc" -eq 0 ] && rc=${PIPESTATUS[0]} ;;
    *) echo "unknown mode $what: all, tests, sanitize, bench, verify or probe"; exit 2 ;;
esac
if [ "$what" = all ] || [ "$what" = bench ]; then
    # shellcheck disable=SC2086   # BENCH_ARGS is a list of options
    "$PY" -m gbs bench ${BENCH_ARGS:---quick} --csv "$OUT/bench.csv" 2>&1 | tee "$OUT/bench.log"
    brc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && rc=$brc
fi
exit "$rc"

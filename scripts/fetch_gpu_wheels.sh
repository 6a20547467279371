#!/usr/bin/env bash
# Download the wheels the H200 image lacks into .whl/ (git-ignored; the device tool carries it):
# numba-cuda 0.30.4 imports np.row_stack, removed in numpy 2.5, which that image ships; humming-kernels (the
# `humming` bench peer, an abi3 wheel) is not on it (its dependencies are: torch, triton, jinja2, safetensors,
# cuda-bindings, tqdm).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "numpy==2.4.*" "ml_dtypes==0.6.0" "humming-kernels==0.1.20"
# cuda.core >= 1.2.0 for programmatic dependent launch (gbs.plan.H200Plan.pdl), apart in .whl/pdl: install it
# (pip install --target ... .whl/pdl/*.whl) only where the image's cuda.core lacks
# LaunchConfig(programmatic_stream_serialization=...); the launch raises an error naming the version otherwise.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/pdl "cuda-core==1.2.2" "cuda-pathfinder==1.9.1"

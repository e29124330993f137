#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session that has a device machine: the CUDA tests
# (the Triton kernels compiled, CUDA graphs, the Triton and flash-attn backends, parity with transformers),
# then the benchmark.
#
# Setup. The device image has torch, triton and transformers but not msgspec: carry it as a wheel
# (/work/.library/device/README.md). Here, once, in the repo root (.gitignore already ignores .whl/):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0
# then run with carry [".whl"]:   bash scripts/gpu_check.sh
# The wheels go to /tmp/site with PYTHONPATH=/tmp/site, as the README does; run there by hand, that is:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
# Logs go to $OUT when it is set (the device machine brings them back), else to /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"

if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# tpengine.kernels is the kernels/ folder (setup.cfg's package_dir): only an install maps it
if ! $PY -c "import tpengine.kernels" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
unset TRITON_INTERPRET  # the kernels run compiled on the GPU, not in the interpreter
export PYTHONUNBUFFERED=1

status=0
{ nvidia-smi -L; $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; \
  $PY -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed (its tests skip)"; \
} 2>&1 | tee "$LOGS/gpu_env.txt"
$PY -m pytest -q -rs -x tests/kernels tests/runner tests/attention tests/engine/test_llm_engine.py 2>&1 | tee "$LOGS/gpu_tests.log" \
    || status=1
$PY scripts/bench.py --device cuda 2>&1 | tee "$LOGS/gpu_bench.log" || status=1
exit $status

#!/usr/bin/env bash
# The GPU checks as one run on a fresh CUDA host, from the repo root:   bash tools/gpu_check.sh
#
# What it does, and what each part takes on one H200 (first run 2026-12-04: docs/benchmarks.md). Each part
# has its own time limit (then SIGINT, SIGKILL 5 s later), so the whole run ends within 8 minutes
# even when a part hangs (its parts' limits sum to 470 s):
#   1. environment, wheels, tpengine importable                                     ~10 s
#   2. every CUDA test on one GPU, no early stop (tests/layers first: dynamo's explain
#      resets compiled code); tests/distributed and the CLI's --tp 2 test need two GPUs
#      and run only where two are visible; tests/entrypoints needs the serve extra
#      (FastAPI, uvicorn, openai), which such a host lacks                  ~2-3 min, cut at 160 s
#   3. benchmarks/bench.py --device cuda: 64 of nano-vllm's requests (inputs and
#      outputs 100-1024, Qwen3-0.6B shape, bf16, max_num_seqs 256), then transformers
#      generate in one batch of 64 (one size only, to fit); TORCH_LOGS=recompiles,
#      graph_breaks on                                                      ~2.5 min, cut at 160 s
#   4. tools/profile_decode.py: 64 sequences x 1024 tokens, per-step host vs GPU time,
#      CUDA-graph replays, decode-attention KV read bandwidth against a device copy   ~40 s, cut at 50 s
#   5. benchmarks/bench_quant.py --device cuda on the same model: bfloat16, fp8, int8 and int4 weights,
#      decode steps at batch 1, 16 and 64, 256-sequence throughput, greedy agreement with bfloat16,
#      and the GPU issue's aims (FP8 step <= 0.6x bfloat16's, throughput >= 1.3x)      ~80 s, cut at 100 s
# A part cut at its limit gets SIGINT: pytest still prints the summary of what ran.
#
# The host needs torch, triton (>= 3.4), transformers, pytest and xxhash; msgspec and flash-attn may be
# missing (flash-attn's tests then skip). A missing package comes from a wheel in .whl/ in the repo
# root (git ignores it), made beforehand on any machine with pip, for the host's Python (3.12 here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0
# (the same for xxhash==4.1.0 if the host lacks it; WHEELS=DIR takes them from DIR instead). The
# wheels go to $SITE (on PYTHONPATH) without their dependencies; tpengine runs from this checkout
# (on PYTHONPATH), with tpengine/kernels linked to kernels/ for the run when no install maps it.
# Nothing else is installed.
#
# Output folder: $OUT if set, else /tmp/gpu_check:
#   env.txt            GPU, versions, which packages came from wheels
#   tests.log          pytest -v -rfEs: each test's result as it ends, every failure and skip named
#                      again at the end, durations of the slowest
#   bench.md           the benchmark table (output tok/s, transformers' baseline, the ratio)
#   torch_logs.txt     the benchmark's stderr: TORCH_LOGS recompiles and graph breaks, with markers
#                      around the timed window, and each side's time as it finishes
#   profile_decode.txt the decode profile
#   quant.md           the quantized weights' table and aims
#   summary.txt        each part's exit status and seconds
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
SITE=${SITE:-/tmp/gpu_check_site}
MODEL_DIR=${MODEL_DIR:-/tmp/gpu_check_model}
WHEELS=${WHEELS:-.whl}
mkdir -p "$LOGS"
: > "$LOGS/summary.txt"
status=0

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, record status and seconds
    local name=$1 limit=$2 started=$SECONDS rc
    shift 2
    timeout -s INT -k 5 "$limit" "$@"
    rc=$?
    echo "$name: exit $rc in $((SECONDS - started)) s (limit $limit s)" | tee -a "$LOGS/summary.txt" >&2
    [ "$rc" -eq 0 ] || status=1
}

# --- 1. environment ------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET  # the kernels run compiled on the GPU, not in the interpreter
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        || { echo "could not install the wheels in $WHEELS/" | tee -a "$LOGS/summary.txt"; exit 1; }
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# tpengine.kernels is the kernels/ folder (setup.cfg's package_dir); without an install mapping it, a link does
if ! $PY -c "import tpengine.kernels" 2>/dev/null && [ ! -e tpengine/kernels ]; then
    ln -s ../kernels tpengine/kernels && trap 'rm -f "$REPO/tpengine/kernels"' EXIT
fi
missing=$($PY -c "
import importlib.util
names = ['torch', 'triton', 'transformers', 'safetensors', 'tokenizers', 'xxhash', 'msgspec', 'numpy', 'tqdm', 'pytest']
print(' '.join(n for n in names if importlib.util.find_spec(n) is None))")
{
    nvidia-smi -L || echo "nvidia-smi: not found"
    $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '| transformers', transformers.__version__, '| CUDA', torch.version.cuda,
'| GPUs', torch.cuda.device_count())"
    $PY -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null \
        || echo "flash_attn: not installed (its tests skip; auto picks Triton)"
    echo "from $WHEELS/: $(ls "$WHEELS" 2>/dev/null | tr '\n' ' ')"
    echo "missing: ${missing:-nothing}"
} 2>&1 | tee "$LOGS/env.txt"
if [ -n "$missing" ] || ! $PY -c "import tpengine.kernels, torch; assert torch.cuda.is_available()"; then
    echo "cannot run: missing packages (${missing:-none}), tpengine.kernels not importable, or no CUDA device" \
        | tee -a "$LOGS/summary.txt"
    exit 1
fi

# --- 2. tests ------------------------------------------------------------------------------------
# the files that run CUDA first (the first H200 run, 2026-12-04, spent its minutes on CPU-only tests), then the rest
tests=(tests/layers tests/runner tests/engine/test_llm_engine.py tests/attention tests/platforms tests/test_config.py
       tests/kernels tests/models tests/engine tests/test_cli.py
       --ignore-glob='tests/kernels/test_cpu_*' --ignore tests/kernels/test_triton_compile.py
       --ignore tests/platforms/test_cpu_dtype.py --ignore tests/runner/test_cpu_replay.py)
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    tests+=(tests/distributed)  # tensor parallelism: one GPU per rank
else
    tests+=(--deselect tests/test_cli.py::test_default_model_from_stdin_at_tp_2_says_it_is_the_tiny_model)
fi
timeout_flag=()
$PY -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 120)  # a hung test fails, the rest run
part tests 160 $PY -m pytest -v -rfEs --durations=15 -p no:cacheprovider "${timeout_flag[@]}" "${tests[@]}" \
    > >(tee "$LOGS/tests.log") 2>&1

# --- 3. benchmark --------------------------------------------------------------------------------
# 64 of nano-vllm's requests: transformers' generate of all 256 in one batch did not finish in 160 s on an H200
TORCH_LOGS=recompiles,graph_breaks part bench 160 $PY benchmarks/bench.py --device cuda --max-num-seqs 256 \
    --num-seqs 64 --hf-batch-size 64 --model-dir "$MODEL_DIR" > >(tee "$LOGS/bench.md") 2> >(tee "$LOGS/torch_logs.txt" >&2)

# --- 4. decode profile ---------------------------------------------------------------------------
part profile 50 $PY tools/profile_decode.py --device cuda --model-dir "$MODEL_DIR" --batch-size 64 \
    --context-len 1024 --steps 32 > >(tee "$LOGS/profile_decode.txt") 2>&1

# --- 5. quantized weights ------------------------------------------------------------------------
part quant 100 $PY benchmarks/bench_quant.py --device cuda --model "$MODEL_DIR" --batch-sizes 1 16 64 \
    --context-len 512 --steps 16 --throughput-seqs 256 --throughput-output 64 > >(tee "$LOGS/quant.md") 2>&1

echo "total: $SECONDS s" | tee -a "$LOGS/summary.txt"
exit $status

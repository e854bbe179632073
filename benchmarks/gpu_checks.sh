#!/usr/bin/env bash
# GPU reliability checks (issue 6), runnable standalone on a lent GPU machine from the repo root, after the CUDA
# build (benchmarks/gpu_session.sh's build step, or `ROPEWKV_CUDA=1 python -m pip install -e . --no-build-isolation
# --no-deps`):
#   1. the edge shapes (tests/gpu_edge_cases.py: head dims 72/160, T not a multiple of any chunk, B*H > SMs*32,
#      tensors past 2^31 elements) on the CUDA and Triton twins;
#   2. the reliability tests on the GPU (bad input, zero-size and NaN cases, determinism, memory growth);
#   3. compute-sanitizer memcheck, racecheck, initcheck and synccheck over the CUDA twin at small shapes: the edge
#      cases without the 2^31 ones, and the bad-input/zero-size/NaN tests, which reach the kernels with odd shapes.
#      (gpu_session.sh runs the same tools over the whole CUDA test suite; this covers the edge shapes.)
#   4. backtrace: tests/test_wkv7.py under cuda-gdb (it debugs host code there), which prints the native stack if the
#      process crashes: on the H200 (2026-11-26) the file died with a segfault in test_cpp_guards_behind_python.
# Logs go to $OUT (default build/gpu-checks): gpu_checks.log (steps 1-2 and the summary) and sanitizer_edges.log
# (step 3, one "ERROR SUMMARY" line per tool). Exit status: 0 when every step passed.
# Knobs: CHECKS (comma list of edges,reliability,memcheck,racecheck,initcheck,synccheck; default all), PYTHON.
# Time limits per step: 150 s edges, 120 s reliability, 60 s per sanitizer, 120 s backtrace (630 s in all: more than
# one device call, so name the steps wanted in CHECKS).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build/gpu-checks}
mkdir -p "$OUT"
LOG=$OUT/gpu_checks.log
SANLOG=$OUT/sanitizer_edges.log
PY=${PYTHON:-python3}
CHECKS=${CHECKS:-edges,reliability,memcheck,racecheck,initcheck,synccheck,backtrace}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
FAILED=()

# run NAME LIMIT_S LOGFILE COMMAND...: only when NAME is in CHECKS, killed after LIMIT_S so that one slow step cannot
# eat the summary.
run() {
    local name=$1 limit=$2 log=$3 rc=0
    shift 3
    [[ ",$CHECKS," == *",$name,"* ]] || return 0
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG" >>"$log"
    timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then FAILED+=("$name (timeout at ${limit}s)"); elif ((rc)); then FAILED+=("$name"); fi
    echo "=== $name: done (${#FAILED[@]} failed so far)" | tee -a "$LOG"
}

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    >>"$LOG" 2>&1 || { echo "gpu_checks.sh: no CUDA device (see $LOG)"; exit 2; }

PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
run edges 150 "$LOG" "${PYTEST[@]}" tests/gpu_edge_cases.py
run reliability 120 "$LOG" "${PYTEST[@]}" tests/test_bad_input.py tests/test_determinism.py

# PYTORCH_NO_CUDA_MEMORY_CACHING: every tensor its own cudaMalloc, so that an out-of-bounds access is not hidden
# inside a larger cached block. Only the CUDA twin: the Triton twin's tests select "triton".
for tool in memcheck racecheck initcheck synccheck; do
    run "$tool" 60 "$SANLOG" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 99 \
        --print-limit 20 --target-processes all "${PYTEST[@]}" -x tests/gpu_edge_cases.py \
        tests/test_bad_input.py -k "(cuda and not past_2_31) or zero or empty or nan or inf"
done

# The host's toolchain; each C++ guard alone in a fresh process, with and without _C_cuda loaded
# (tools/diag_wkv7_cpp_guards.py); the file's CPU-twin tests and the guard test alone (clean there but not in the
# whole file: earlier GPU tests leave something behind); then the file under cuda-gdb (-batch: run, and on a signal
# print the stack of every thread, then quit).
run backtrace 120 "$LOG" bash -c "$PY -VV; gcc --version | head -1; ldd --version | head -1; \
    grep -m1 'model name' /proc/cpuinfo; $PY tools/diag_wkv7_cpp_guards.py; \
    ${PYTEST[*]} -x tests/test_wkv7.py -k 'cpu_twin or errors or cpp_guards'; cuda-gdb -batch -ex run \
    -ex 'thread apply all bt 30' -ex 'info sharedlibrary' --args ${PYTEST[*]} -p no:faulthandler tests/test_wkv7.py"

{
    echo "## gpu_checks.sh summary ($(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS}s, CHECKS=$CHECKS)"
    grep -E '[0-9]+ (passed|failed)' "$LOG" | sed 's/^/- pytest: /'
    grep -h 'ERROR SUMMARY' "$SANLOG" 2>/dev/null | sed 's/^/- sanitizer: /'
    echo "- failed steps: ${FAILED[*]:-none}"
} | tee -a "$LOG"
((${#FAILED[@]} == 0))

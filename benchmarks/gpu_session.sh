#!/usr/bin/env bash
# One whole GPU session in one device call, run from the repo root on the lent machine:
#   env -> install carried peer wheels (.whl/) -> build ropewkv with CUDA -> GPU test suite -> parity ->
#   RoPE and RWKV-7 benchmarks -> compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the CUDA tests.
# Every step has its own timeout and the whole script a deadline (TOTAL_S, default 540 s, inside the tool's 600 s):
# a step that would not fit is skipped and says so. Results land flat in $OUT (at most 8 files come back):
#   session.log (every step's output), sanitizer.log, rope.{json,md,png}, rwkv7.{json,md,png}; a benchmark cut
#   short by its timeout still leaves its rows so far in <name>.json ("complete": false).
# The summary (one line per step, the speed-up notes, the parity count) is printed last.
#
# Knobs (environment): STEPS (comma list, default all, in the order below), TOTAL_S, PLOT=0 to skip the PNGs,
# BENCH_ARGS (extra args for both benchmarks, e.g. --quick), SAN_K (pytest -k for the sanitizers; pytest's rc 5
# means no test matched it), ROPEWKV_COMMIT (the commit to print in the tables: the copy may have no .git),
# TORCH_CUDA_ARCH_LIST (default 9.0a: H100/H200 only, half the compile time of a multi-arch build).
# Typical use, three calls while the machine stays warm (later ones reuse the built python/ropewkv/_C_cuda*.so):
#   1) bash benchmarks/gpu_session.sh                              (sanitizers run only if time is left)
#   2) STEPS=env,wheels,build,memcheck,racecheck,initcheck,synccheck bash benchmarks/gpu_session.sh
#   3) STEPS=env,build,checks bash benchmarks/gpu_session.sh      (benchmarks/gpu_checks.sh: edge shapes, the
#      reliability tests on the GPU and the sanitizers over them; not in the default STEPS: $OUT holds 8 files)
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-session}
mkdir -p "$OUT" "$ROOT/build/tmp"
ALL=env,wheels,build,test,parity,rope,rwkv7,memcheck,racecheck,initcheck,synccheck
STEPS=${STEPS:-$ALL}
TOTAL_S=${TOTAL_S:-540}
DEADLINE=$((SECONDS + TOTAL_S))
LOG=$OUT/session.log
SANLOG=$OUT/sanitizer.log
PY=${PYTHON:-python3}
PLOT_ARG=$([[ ${PLOT:-1} == 1 ]] && echo --plot)
SAN_K=${SAN_K:-cuda and not triton and not compile}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the script's plumbing on a machine without a GPU
export PY SAN_K DEVICE PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export TMPDIR=$ROOT/build/tmp TRITON_CACHE_DIR=$ROOT/build/triton TORCHINDUCTOR_CACHE_DIR=$ROOT/build/inductor
unset TRITON_INTERPRET  # real Triton on the GPU
SUMMARY=()

# step NAME BUDGET_S LOGFILE COMMAND...: run if NAME is in STEPS and time is left, under min(budget, time left).
step() {
    local name=$1 budget=$2 log=$3
    shift 3
    if [[ ",$STEPS," != *",$name,"* ]]; then return 0; fi
    local left=$((DEADLINE - SECONDS - 10))
    local limit=$((budget < left ? budget : left))
    if ((limit < 15)); then SUMMARY+=("$name: skipped (out of time)"); return 0; fi
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    [[ $log == "$LOG" ]] || echo "=== $name: $*" >>"$log"
    local start=$SECONDS rc=0
    timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@" >>"$log" 2>&1 || rc=$?  # bash: runs functions too
    local status=ok
    if ((rc == 124 || rc == 137)); then status="TIMEOUT at ${limit}s"; elif ((rc)); then status="FAIL (rc $rc)"; fi
    SUMMARY+=("$name: $status in $((SECONDS - start))s")
    echo "=== $name: $status" | tee -a "$LOG"
}

environment() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    nvcc --version | tail -2
    compute-sanitizer --version | head -2
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_properties(0))"
    git log --oneline -1 2>/dev/null || true
}

install_wheels() {
    if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no .whl/ carried: the peers will show as n/a"; return 0; fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    ls /tmp/site
}

build() {
    local so
    so=$(ls python/ropewkv/_C_cuda*.so 2>/dev/null | head -1)
    if [[ $DEVICE == cuda && -n $so && -z $(find csrc setup.py -newer "$so" -print -quit) ]] &&
        "$PY" -c "import ropewkv._C_cuda"; then
        echo "build up to date ($so newer than csrc/ and setup.py): not rebuilt"
        return 0
    fi
    local cuda=auto
    [[ $DEVICE == cuda ]] && cuda=1  # fail loudly if the CUDA extension cannot be built
    ROPEWKV_CUDA=$cuda "$PY" -m pip install -e . --no-build-isolation --no-deps &&
        "$PY" -c "import torch, ropewkv; print('backends:', ropewkv.available_backends(torch.device('$DEVICE')))"
}

# PYTORCH_NO_CUDA_MEMORY_CACHING: every tensor its own cudaMalloc, so the sanitizers see out-of-bounds accesses
# that the caching allocator would hide inside a larger block.
sanitize() {
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$1" --error-exitcode 99 --print-limit 20 \
        --target-processes all "$PY" -m pytest tests -q -x -p no:cacheprovider -m "not slow" -k "$SAN_K"
}

export -f environment install_wheels build sanitize
step env 30 "$LOG" environment
step wheels 60 "$LOG" install_wheels
if [[ -d /tmp/site ]]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
step build 300 "$LOG" build
step test 150 "$LOG" "$PY" -m pytest tests -q -x -p no:cacheprovider
step parity 90 "$LOG" "$PY" -m ropewkv parity --device "$DEVICE"
# shellcheck disable=SC2086  # BENCH_ARGS and PLOT_ARG are word lists
step rope 150 "$LOG" "$PY" benchmarks/rope.py --device "$DEVICE" --out "$OUT" $PLOT_ARG ${BENCH_ARGS:-}
# shellcheck disable=SC2086
step rwkv7 200 "$LOG" "$PY" benchmarks/rwkv7.py --device "$DEVICE" --out "$OUT" $PLOT_ARG ${BENCH_ARGS:-}
step memcheck 90 "$SANLOG" sanitize memcheck
step racecheck 60 "$SANLOG" sanitize racecheck
step initcheck 45 "$SANLOG" sanitize initcheck
step synccheck 45 "$SANLOG" sanitize synccheck
step checks 500 "$LOG" env OUT="$OUT" PYTHON="$PY" bash benchmarks/gpu_checks.sh

{
    echo
    echo "## GPU session summary ($(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS}s, STEPS=$STEPS)"
    printf -- '- %s\n' "${SUMMARY[@]}"
    grep -h -- '^- .* is [0-9.]*x ' "$OUT"/rope.md "$OUT"/rwkv7.md 2>/dev/null
    grep -E '^[0-9]+ passed, [0-9]+ failed$' "$LOG" | tail -1 | sed 's/^/- parity: /'
    grep -E '[0-9]+ (passed|failed).* in [0-9.]+s' "$LOG" | tail -1 | sed 's/^/- pytest (last run): /'
    grep -E 'ERROR SUMMARY' "$SANLOG" 2>/dev/null | sed 's/^/- sanitizer: /'
    echo "- files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} | tee -a "$LOG"

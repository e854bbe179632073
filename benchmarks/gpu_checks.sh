#!/usr/bin/env bash
# GPU reliability checks (issue 6), runnable standalone on a lent GPU machine from the repo root, after the CUDA
# build (benchmarks/gpu_session.sh's build step, or `ROPEWKV_CUDA=1 python -m pip install -e . --no-build-isolation
# --no-deps`), or inside one device call with the build: `PLAN=checks CHECKS=backtrace,edges bash
# benchmarks/gpu_session.sh`. The steps, in priority order (each runs only when named in CHECKS):
#   1. backtrace: the segfault of tests/test_wkv7.py in test_cpp_guards_behind_python (H200 and H100, 2026-11-26):
#      the file's tests up to and including that one under cuda-gdb (it debugs host code there), which prints the
#      native stack if the process crashes; then each C++ guard alone in a fresh process, with and without _C_cuda
#      (tools/diag_wkv7_cpp_guards.py), and the file's CPU-twin tests with the guard test alone.
#   2. edges: the edge shapes (tests/gpu_edge_cases.py: head dims 72/160, T not a multiple of any chunk,
#      B*H > SMs*32, tensors past 2^31 elements) on the CUDA and Triton twins;
#   3. reliability: the reliability tests on the GPU (bad input, zero-size and NaN cases, determinism, memory growth);
#   4. memcheck, racecheck, initcheck, synccheck: compute-sanitizer over SAN_IDS, CUDA-backend cases only (the edge
#      shapes without the 2^31 ones, and the bad-input tests that call the CUDA twin alone). No Triton run: racecheck
#      reports hazards inside Triton's own tl.sum reductions (triton-lang/triton#7264), which would fail the step for
#      nothing; no CPU-only case: the tools would watch nothing. The named tools run at once, one process each on the
#      one GPU, as gpu_session.sh's PLAN=sanitize does (four at once took about as long as racecheck alone).
# Time limits (seconds): backtrace 240 (test_wkv7.py ran 53 s natively up to the crash; under cuda-gdb slower, so the
# debugger gets the limit less 60 s and the diagnostics after it the rest), edges 150, reliability 120, the sanitizers
# 180 together (25 tests; PLAN=sanitize's 11 get 200 s): 690 s in all, more than one device call. The default CHECKS=backtrace,edges (390 s) fits the ~450 s a
# cold PLAN=checks call leaves after env and build (60 s); the rest, CHECKS=reliability,memcheck,racecheck,initcheck,
# synccheck (300 s), fits a second, warm call. Besides, every step runs under min(its limit, the time left of
# CHECKS_TOTAL_S), so the summary is always written: a step with under 10 s left is "skipped (out of time)".
# Logs go to $OUT (default build/gpu-checks): gpu_checks.log (every step but the sanitizers, and the summary) and
# sanitizer_edges.log (the sanitizers, one "ERROR SUMMARY" or "RACECHECK SUMMARY" line per tool). Exit status: 0 when
# every step named in CHECKS ran and passed.
# Knobs: CHECKS (comma list of backtrace,edges,reliability,memcheck,racecheck,initcheck,synccheck), CHECKS_TOTAL_S
# (default: 15 s less than gpu_session.sh's step limit, STEP_LIMIT_S, when run by it, else 540), PYTHON, DEVICE (cuda;
# cpu: a dry run on a machine without a GPU, the tests without compute-sanitizer or cuda-gdb, where the CUDA tests
# skip), PLAN_ONLY=1 (print the plan, the sanitizers' test ids and the backtrace's, run nothing:
# tests/test_gpu_session.py).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit
OUT=${OUT:-$PWD/build/gpu-checks}
mkdir -p "$OUT"
LOG=$OUT/gpu_checks.log
SANLOG=$OUT/sanitizer_edges.log
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
CHECKS=${CHECKS:-backtrace,edges}
STEP_LIMIT_S=${STEP_LIMIT_S:-}
CHECKS_TOTAL_S=${CHECKS_TOTAL_S:-$((${STEP_LIMIT_S:-555} - 15))}
DEADLINE=$((SECONDS + CHECKS_TOTAL_S))
unset TRITON_INTERPRET
export PY DEVICE PYTHONUNBUFFERED=1
FAILED=() SUMMARY=()
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
SANITIZERS=(memcheck racecheck initcheck synccheck)
# The order is the priority; the limits are seconds (see above).
STEPS=(backtrace edges reliability sanitizers)
declare -A LIMIT=([backtrace]=240 [edges]=150 [reliability]=120 [sanitizers]=180)

# CUDA-backend cases only; tests/test_gpu_session.py checks that each is collected and names no Triton or CPU case.
SAN_IDS=(
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[False-72-72-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[False-72-40-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[False-160-160-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[False-160-96-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[True-72-72-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[True-72-40-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[True-160-160-cuda]"
    "tests/gpu_edge_cases.py::test_rope_odd_head_dims[True-160-96-cuda]"
    "tests/gpu_edge_cases.py::test_rope_more_heads_than_sms_x32[cuda]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[1-cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[1-cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[15-cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[15-cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[17-cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[17-cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[67-cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[67-cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[127-cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_t_not_a_multiple_of_any_chunk[127-cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_inputs_one_element_off_alignment[cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_inputs_one_element_off_alignment[cuda-chunked]"
    "tests/gpu_edge_cases.py::test_wkv7_more_heads_than_sms_x32[cuda-sequential]"
    "tests/gpu_edge_cases.py::test_wkv7_more_heads_than_sms_x32[cuda-chunked]"
    "tests/test_bad_input.py::test_wkv7_chunked_nan_stays_in_its_chunk_and_after[cuda-bf16-16]"
    "tests/test_bad_input.py::test_cuda_backwards_refuse_cotangents_on_another_device"
)

wanted() {
    if [[ $1 == sanitizers ]]; then
        local tool
        for tool in "${SANITIZERS[@]}"; do [[ ",$CHECKS," == *",$tool,"* ]] && return 0; done
        return 1
    fi
    [[ ",$CHECKS," == *",$1,"* ]]
}

# test_wkv7.py's test ids in file order, up to and including test_cpp_guards_behind_python: the crash needs what the
# GPU tests before it leave behind (the guard test alone is clean), and the tests after it only cost debugger time.
backtrace_ids() {
    "${PYTEST[@]}" --collect-only tests/test_wkv7.py 2>/dev/null | awk '/^tests\/test_wkv7\.py::/ {
        guard = $0 ~ /::test_cpp_guards_behind_python/
        if (seen && !guard) exit
        print
        if (guard) seen = 1
    }'
}

# The host's toolchain; the native stack (cuda-gdb -batch: run, and on a signal print the stack of every thread, then
# quit; gdb escapes the ids' brackets for the shell it starts the program with: gdb 13 here passed them as written,
# and `set startup-with-shell off` would not, leaving its escapes in), under its own limit so that the diagnostics after
# it always run; each C++ guard alone in a fresh process, with and without _C_cuda loaded (only
# "cu" crashing: the tensor streamed into its message; only with _C_cuda: that extension's presence); the file's
# CPU-twin tests and the guard test alone (clean there but not in the whole file: state left by earlier GPU tests).
backtrace() {
    local ids last rc=0 limit_s=${CHECK_LIMIT_S:-${LIMIT[backtrace]}} debug_s
    debug_s=$((limit_s > 80 ? limit_s - 60 : 20))
    mapfile -t ids < <(backtrace_ids)
    last=${ids[${#ids[@]} - 1]:-none}
    echo "${#ids[@]} test ids, the last: $last"
    [[ $last == *::test_cpp_guards_behind_python* ]] || { echo "test_cpp_guards_behind_python not collected"; rc=1; }
    "$PY" -VV
    gcc --version | head -1
    ldd --version | head -1
    grep -m1 'model name' /proc/cpuinfo
    if [[ $DEVICE == cuda ]]; then
        echo "--- cuda-gdb (limit ${debug_s}s)"
        timeout --kill-after=5 "$debug_s" cuda-gdb -batch -ex run \
            -ex 'thread apply all bt 30' -ex 'info sharedlibrary' \
            --args "${PYTEST[@]}" -p no:faulthandler "${ids[@]}" || rc=$?
    else
        echo "--- the tests up to the guard test, no debugger (DEVICE=$DEVICE, limit ${debug_s}s)"
        timeout --kill-after=5 "$debug_s" "${PYTEST[@]}" "${ids[@]}" || rc=$?
    fi
    echo "--- each guard in a fresh process"
    "$PY" tools/diag_wkv7_cpp_guards.py || rc=$?
    echo "--- the CPU-twin tests and the guard test alone"
    "${PYTEST[@]}" -x tests/test_wkv7.py -k 'cpu_twin or errors or cpp_guards' || rc=$?
    return "$rc"
}

# PYTORCH_NO_CUDA_MEMORY_CACHING: every tensor its own cudaMalloc, so that an out-of-bounds access is not hidden
# inside a larger cached block. Each tool named in CHECKS at once, its own log; the logs are appended to the step's
# log when all are done (a tool stopped at the limit included), with one line per tool.
sanitizers() {
    local tools=() pids=() tool i rc status failed=0 tool_cmd limit_s=${CHECK_LIMIT_S:-${LIMIT[sanitizers]}}
    for tool in "${SANITIZERS[@]}"; do wanted "$tool" && tools+=("$tool"); done
    for tool in "${tools[@]}"; do
        tool_cmd=()
        if [[ $DEVICE == cuda ]]; then
            tool_cmd=(compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 --target-processes all)
        fi
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout --kill-after=3 "$((limit_s - 5))" "${tool_cmd[@]}" \
            "${PYTEST[@]}" -x "${SAN_IDS[@]}" >"$OUT/sanitizer_$tool.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!tools[@]}"; do
        rc=0
        wait "${pids[i]}" || rc=$?
        if ((rc == 0)); then status=ok
        elif ((rc == 124 || rc == 137)); then status="stopped at the time limit" failed=1
        else status="FAIL (rc $rc)" failed=1; fi
        echo "--- ${tools[i]}"
        cat "$OUT/sanitizer_${tools[i]}.log"
        echo  # a tool stopped mid-line
        echo "sanitizer ${tools[i]}: $status; $(grep -E -o '[0-9]+ (passed|failed|skipped)[^=]*' \
            "$OUT/sanitizer_${tools[i]}.log" | tail -1)"
        rm -f "$OUT/sanitizer_${tools[i]}.log"
    done
    return "$failed"
}

# `bash gpu_checks.sh __step NAME`: one step's function, in a fresh process that timeout can stop (run, below).
if [[ ${1:-} == __step ]]; then
    "$2"
    exit
fi

if [[ ${PLAN_ONLY:-0} == 1 ]]; then
    total=0
    echo "## gpu_checks.sh plan (CHECKS=$CHECKS, DEVICE=$DEVICE, CHECKS_TOTAL_S=$CHECKS_TOTAL_S)"
    for step in "${STEPS[@]}"; do
        if wanted "$step"; then
            echo "- $step: ${LIMIT[$step]}s"
            total=$((total + ${LIMIT[$step]}))
        else
            echo "- $step: ${LIMIT[$step]}s (not in CHECKS)"
        fi
    done
    echo "- the steps in CHECKS: ${total}s"
    echo "## sanitizer test ids"
    printf '%s\n' "${SAN_IDS[@]}"
    echo "## backtrace test ids"
    backtrace_ids
    exit 0
fi

# run NAME LOGFILE COMMAND...: only when NAME is in CHECKS, killed after min(its limit, the time left) so that one
# slow step cannot eat the summary; the step functions read their limit from CHECK_LIMIT_S.
run() {
    local name=$1 log=$2 rc=0 limit start status result
    shift 2
    wanted "$name" || return 0
    limit=${LIMIT[$name]}
    if ((DEADLINE - SECONDS < limit)); then limit=$((DEADLINE - SECONDS)); fi
    if ((limit < 10)); then
        FAILED+=("$name (skipped: out of time)")
        SUMMARY+=("$name: skipped (out of time)")
        echo "=== $name: skipped (out of time)" | tee -a "$LOG"
        return
    fi
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    [[ $log == "$LOG" ]] || echo "=== $name (limit ${limit}s): $*" >>"$log"
    start=$SECONDS
    CHECK_LIMIT_S=$limit timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then
        FAILED+=("$name (timeout at ${limit}s)") status="TIMEOUT at ${limit}s"
    elif ((rc)); then
        FAILED+=("$name") status="FAIL (rc $rc)"
    else
        status=ok
    fi
    result=$(tail -n 5 "$log" | grep -E -o '[0-9]+ (passed|failed|skipped|error)[^=]*' | tail -1)
    SUMMARY+=("$name: $status in $((SECONDS - start))s${result:+ (last pytest: $result)}")
    echo "=== $name: $status" | tee -a "$LOG"
}

if [[ $DEVICE == cuda ]]; then
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
        >>"$LOG" 2>&1 || { echo "gpu_checks.sh: no CUDA device (see $LOG)"; exit 2; }
fi

run backtrace "$LOG" bash benchmarks/gpu_checks.sh __step backtrace
run edges "$LOG" "${PYTEST[@]}" tests/gpu_edge_cases.py
run reliability "$LOG" "${PYTEST[@]}" tests/test_bad_input.py tests/test_determinism.py
run sanitizers "$SANLOG" bash benchmarks/gpu_checks.sh __step sanitizers

{
    echo "## gpu_checks.sh summary ($(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS}s of CHECKS_TOTAL_S=$CHECKS_TOTAL_S," \
        "CHECKS=$CHECKS, DEVICE=$DEVICE)"
    printf -- '- %s\n' "${SUMMARY[@]}"
    grep -h -E '^sanitizer [a-z]+: |(ERROR|RACECHECK) SUMMARY' "$SANLOG" 2>/dev/null | sed 's/^/- /'
    echo "- failed steps: ${FAILED[*]:-none}"
} | tee -a "$LOG"
((${#FAILED[@]} == 0))

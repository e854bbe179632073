#!/usr/bin/env bash
# One GPU session per device call, planned so that the call always returns with its numbers, from the repo root:
#   run(command="ROPEWKV_COMMIT=<sha> bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# PLAN=main (default), in priority order: env -> wheels -> build (asserts the `cuda` backend loaded) -> RoPE training
#   and decode rows (ropewkv, eager HF, Liger) -> ropewkv's WKV7 training rows (B8 T4096, N=64 and N=128, no
#   torch.compile) -> parity on cuda and triton -> WKV7 decode and log-decay rows -> host overhead at decode -> FLA's
#   WKV7 training rows (its autotuning on first use costs minutes, so it runs after our rows, not among them) -> the
#   other WKV7 rows (torch.compile, the eager-sized shape) -> the other RoPE rows -> pytest, one step per test
#   file that runs on the GPU (GPU_TESTS below; a new tests/test_*.py fails tests/test_gpu_session.py until it is put
#   in GPU_TESTS or HOST_TESTS), each under pytest-timeout.
# PLAN=tests: env -> wheels -> build -> the pytest steps alone (a second call, when the first ran out of time for them).
# PLAN=sanitize: env -> build -> compute-sanitizer memcheck, racecheck, initcheck and synccheck, all four at once (one
#   process each on the one GPU, each its own log, the logs appended to session.log when all are done) over SAN_TESTS
#   (a handful of small named tests that reach every CUDA kernel). SAN_TOOLS picks the tools. A second call: the build
#   is reused while the machine is warm.
# PLAN=checks: env -> build -> benchmarks/gpu_checks.sh (the segfault's backtrace, edge shapes, reliability tests,
#   sanitizers over the CUDA edge cases). Name its steps in CHECKS: `PLAN=checks CHECKS=backtrace,edges` (its default,
#   390 s of limits, fits a cold call), then on the warm machine `PLAN=checks
#   CHECKS=reliability,memcheck,racecheck,initcheck,synccheck` (300 s); it clips its steps to this step's limit.
#
# The time plan: each step has a budget (seconds, measured in benchmarks/NOTES.md); a step runs under
# min(budget, time left before TOTAL_S), is killed at that limit, and the steps after it still run while time is left,
# else show as "skipped (out of time)". The plan is printed first and the summary last, one line per step.
# Rebuilds happen only when tools/source_hash.sh (csrc/, setup.py, build switches) differs from build/source.hash.
#
# $OUT gets at most 8 files (the device tool's limit): session.log (every step's output, the summary last),
# results.md (the benchmark tables and the summary: benchmarks/results/ material), rope.json, rwkv7.json,
# host_overhead.json, rope.png, rwkv7.png; checks adds gpu_checks.log and sanitizer_edges.log.
# A benchmark cut short keeps its rows so far in its .json ("complete": false).
#
# Knobs (environment): PLAN, STEPS (comma list: only these steps of the plan), TOTAL_S (default 540, inside the tool's
# 600 s), SAN_TOOLS (PLAN=sanitize: the tools, space-separated; default all four), DEVICE (cuda; cpu: a dry run of the
# same plumbing on a machine without a GPU, as tests/test_gpu_session.py runs it), TESTS (test files, default
# GPU_TESTS), TEST_TIMEOUT_S (per test, default 120), BENCH_ARGS (extra arguments for every benchmark, e.g.
# --quick), PLOT=0 (no PNGs), PYTHON (default python3), ROPEWKV_COMMIT (the commit printed in the tables: the copy may
# have no .git), TORCH_CUDA_ARCH_LIST (default 9.0a: H100/H200 only).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-session/out}
mkdir -p "$OUT" "$ROOT/build/gpu-session" "$ROOT/build/tmp"
# The benchmarks' own files, published to $OUT after every step: a folder of this run's own, removed at its end. Never
# a shared path (nor an inherited $WORK, which this script exports): a dry run inside a session (tests/
# test_gpu_session.py on the GPU machine) once wiped the session's folder and left its CPU rows there to be published.
WORK=$(mktemp -d "$ROOT/build/gpu-session/work.XXXXXX") || exit
trap 'rm -rf "$WORK"' EXIT
PLAN=${PLAN:-main}
DEVICE=${DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-540}
DEADLINE=$((SECONDS + TOTAL_S))
LOG=$OUT/session.log
PY=${PYTHON:-python3}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}
read -r -a BENCH <<<"--device $DEVICE --out $WORK $([[ ${PLOT:-1} == 1 ]] && echo --plot) ${BENCH_ARGS:-}"
SAN_TESTS=(
    "tests/test_rope.py::test_layouts_styles_views_without_copy[True-thd]"
    "tests/test_rope.py::test_gqa_mqa_and_q_only_match_separate_calls"
    "tests/test_rope.py::test_cos_sin_backward_is_the_transpose_on_every_twin"
    "tests/test_wkv7.py::test_sequence_lengths[17]"
    "tests/test_wkv7.py::test_varlen_uneven[True]"
    "tests/test_wkv7.py::test_head_sizes[128]"
    "tests/test_wkv7.py::test_step_equals_one_token_and_updates_in_place[loglog]"
    "tests/test_decay.py::test_non_contiguous_and_empty"
    "tests/test_wkv7_chunked.py::test_matches_fp64_reference[T37-N32-loglog]"
    "tests/test_wkv7_chunked.py::test_matches_fp64_reference[varlen-N32-raw]"
    "tests/test_wkv7_chunked.py::test_matches_fp64_reference[T16-N64-no-state-log]"
    "tests/test_wkv7_chunked.py::test_low_precision_io[dtype3-bf16]"  # the CUDA chunked forward's mma form
)
# The default TESTS: the files that run something on a CUDA device when one is present (the `device` fixture, which is
# the GPU there, or CUDA tensors of their own), most telling first: the kernels' parity, the reliability tests, then the
# integrations (patched models, compat layers, the demo). tests/gpu_edge_cases.py last: gpu_checks.sh runs it too.
GPU_TESTS=(
    tests/test_rope.py tests/test_wkv7.py tests/test_wkv7_chunked.py tests/test_decay.py tests/test_qk_norm_rope.py
    tests/test_wkv7_triton.py tests/test_triton_rope_kernel.py tests/test_rope_mrope.py tests/test_rope_precision.py
    tests/test_rope_angle.py tests/test_wkv7_conventions.py tests/test_wkv7_triton_bounds.py tests/test_host_fast_path.py
    tests/test_bad_input.py tests/test_determinism.py tests/test_fuzz.py
    tests/test_nn_rwkv7.py tests/test_patch_transformers.py tests/test_patch_qk_norm.py tests/test_patch_fla.py
    tests/test_compat_fla.py tests/test_compat_serving.py tests/test_hub_kernels.py tests/test_demo.py
    tests/test_reference.py tests/test_opcheck.py
    tests/gpu_edge_cases.py
)
# Never worth GPU time: the host emulations of the CUDA kernels, compile-only checks (nvcc, Triton for sm_90 without a
# GPU), CPU-only runs (the benchmarks' CPU smoke tests, gloo, the README's examples, meta-device and CPU model tests)
# and these scripts' own tests. tests/test_gpu_session.py checks that every tests/test_*.py is in one list or the
# other, and that each file using the `device` fixture is in GPU_TESTS.
# shellcheck disable=SC2034  # read by tests/test_gpu_session.py, not here
HOST_TESTS=(
    tests/test_benchmarks.py tests/test_build.py tests/test_cuda_block_on_host.py tests/test_distributed.py
    tests/test_gpu_session.py tests/test_mma_bf16_on_host.py tests/test_nn_rotary.py tests/test_patch_exact_angles.py
    tests/test_readme.py tests/test_rope_cuda_on_host.py tests/test_rope_thread_map.py tests/test_setup_venv.py
    tests/test_static_report.py tests/test_triton_compile.py tests/test_wkv7_chunked_cuda_on_host.py
    tests/test_wkv7_cuda_dtypes.py tests/test_wkv7_cuda_on_host.py tests/test_wkv7_step_lanes.py
)
export PY DEVICE WORK OUT PYTHONUNBUFFERED=1 ROPEWKV_FAILURES_NOW=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TMPDIR=$ROOT/build/tmp TRITON_CACHE_DIR=$ROOT/build/triton TORCHINDUCTOR_CACHE_DIR=$ROOT/build/inductor
unset TRITON_INTERPRET  # real Triton on the GPU (and no Triton twin in the CPU dry run)
if [[ $DEVICE == cuda ]]; then
    export ROPEWKV_CUDA=1 ROPEWKV_EXPECT_GPU=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
    EXPECTED_BACKEND=cuda
else
    EXPECTED_BACKEND=cpu
fi
# The wheels step installs the peers there; every later step (a fresh bash) must see them, so export it up front.
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# ---- the steps -------------------------------------------------------------------------------------------------------
environment() {
    if [[ $DEVICE == cuda ]]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
        nvcc --version | tail -2
    fi
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_properties(0))"
    git log --oneline -1 2>/dev/null || true
    if [[ $DEVICE == cuda ]] && ! "$PY" -c "import torch; assert torch.cuda.is_available()"; then
        echo "DEVICE=cuda but torch sees no GPU: stopping (a CPU run would fail everywhere for the wrong reason)"
        return 3
    fi
}

install_wheels() {
    if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no .whl/ carried: the peers will show as n/a"; return 0; fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    ls /tmp/site
}

build() {
    local want have
    want=$(tools/source_hash.sh)
    have=$(cat build/source.hash 2>/dev/null || true)
    if [[ $want == "$have" ]]; then
        echo "build up to date (source hash $want): not rebuilt"
    else
        echo "source hash ${have:-none} -> $want: building"
        "$PY" -m pip install -e . --no-build-isolation --no-deps || return
        echo "$want" >build/source.hash
    fi
    "$PY" -c "import torch, ropewkv
backends = ropewkv.available_backends(torch.device('$DEVICE'))
print('backends:', backends)
assert '$EXPECTED_BACKEND' in backends, ropewkv._backend.unavailable_reason('$EXPECTED_BACKEND', torch.device('$DEVICE'))"
}

# The tools run at once, one process each on the one GPU: on the H100 (2026-11-26) all four took 51 s over five tests,
# about what racecheck alone takes. Each writes $WORK/<tool>.log, appended to the step's output when all are done (a
# tool stopped at the time limit included), and one line to $WORK/sanitize.md for the summary. racecheck reports
# write-write hazards inside Triton's own cross-warp reductions (tl.sum through shared memory, triton-lang/triton#7264:
# seen in our Triton chunked forward on 2026-11-26), so its failure must be read kernel by kernel; the CUDA kernels
# showed 0 hazards. PYTORCH_NO_CUDA_MEMORY_CACHING: every tensor its own cudaMalloc, so the sanitizer sees
# out-of-bounds accesses that the caching allocator would hide inside a larger block. The dry run runs the same tests
# without the tool.
sanitize_one() {
    local tool=() tests
    if [[ $DEVICE == cuda ]]; then
        tool=(compute-sanitizer --tool "$1" --error-exitcode 99 --print-limit 20 --target-processes all)
    fi
    read -r -a tests <<<"$SAN_TESTS_LIST"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${tool[@]}" "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
}

sanitize() {
    local tools pids=() i rc failed=0 stopped=0 status
    read -r -a tools <<<"${SAN_TOOLS:-memcheck racecheck initcheck synccheck}"
    # Each tool stops 10 s before the step's limit, so that this shell still prints every log and summary line.
    local limit=$((STEP_LIMIT_S > 15 ? STEP_LIMIT_S - 10 : 5))
    for tool in "${tools[@]}"; do
        timeout --kill-after=3 "$limit" bash -c "sanitize_one $tool" >"$WORK/$tool.log" 2>&1 &
        pids+=($!)
    done
    : >"$WORK/sanitize.md"
    for i in "${!tools[@]}"; do
        rc=0
        wait "${pids[i]}" || rc=$?
        if ((rc == 0)); then status=ok
        elif ((rc == 124 || rc == 137)); then status="stopped at the time limit" stopped=1
        else status="FAIL (rc $rc)" failed=1; fi
        echo "- ${tools[i]}: $status; $(grep -E -o '[0-9]+ (passed|failed)[^=]*' "$WORK/${tools[i]}.log" | tail -1)" \
            "$(grep -E -o '(ERROR|RACECHECK) SUMMARY.*' "$WORK/${tools[i]}.log" | tail -1)" >>"$WORK/sanitize.md"
    done
    for tool in "${tools[@]}"; do
        echo "--- $tool ($WORK/$tool.log)"
        cat "$WORK/$tool.log"
        echo  # a tool stopped mid-line
    done
    cat "$WORK/sanitize.md"
    if ((failed)); then return 1; elif ((stopped)); then return 124; fi  # 124: the step shows as TIMEOUT
}

checks() {
    OUT=$WORK PYTHON="$PY" bash benchmarks/gpu_checks.sh
}

# results.md from the benchmark tables so far, and the JSON/PNG files, into $OUT.
publish() {
    # The JSON is rewritten after every row, the .md only when a benchmark finishes: a step cut short after one that
    # finished leaves the earlier table beside a JSON that says "complete": false.
    {
        echo "# GPU session results: $(date -u '+%Y-%m-%d %H:%M UTC'), PLAN=$PLAN, DEVICE=$DEVICE"
        for name in rwkv7 rope host_overhead; do
            if [[ -f $WORK/$name.json ]] && grep -E -q '"complete": *false' "$WORK/$name.json"; then
                echo; echo "## $name: cut short, its rows so far are in $name.json"
                if [[ -f $WORK/$name.md ]]; then
                    echo; echo "The table below is an earlier step's, which finished; the rows since are in $name.json alone."
                    echo; cat "$WORK/$name.md"
                fi
            elif [[ -f $WORK/$name.md ]]; then
                echo; cat "$WORK/$name.md"
            elif [[ -f $WORK/$name.json ]]; then
                echo; echo "## $name: cut short, its rows so far are in $name.json"
            fi
        done
    } >"$OUT/results.md"
    cp "$WORK"/*.json "$WORK"/*.png "$OUT"/ 2>/dev/null || true
}

# ---- the plan --------------------------------------------------------------------------------------------------------
# name budget_s command...: budgets are the GPU estimates of benchmarks/NOTES.md ("Time plan").
NAMES=() BUDGETS=() COMMANDS=()
plan() {
    NAMES+=("$1")
    BUDGETS+=("$2")
    COMMANDS+=("$(printf '%q ' "${@:3}")")
}
plan env 45 environment  # importing torch and triton: 9-10 s on a fresh H100/H200, longer on a loaded CI (dry run)
case $PLAN in
main | tests)
    plan wheels 10 install_wheels
    plan build 120 build  # 58-60 s from scratch (H100, H200); 0 when the source hash matches
    if [[ $PLAN == main ]]; then
        # Every ropewkv row before any peer's autotuning: on the H100 (2026-11-26) one step of all the B8 T4096 rows
        # spent its 300 s on N=64 and FLA's first-use autotuning, and N=128 never started. 240 s: ~100 s per head
        # size for our 8 rows (Triton JIT included; estimated, see benchmarks/NOTES.md "Time plan").
        plan rope-train 75 "$PY" benchmarks/rope.py "${BENCH[@]}" --no-compile --shapes train,decode \
            --only "ropewkv,eager HF,Liger"
        plan rwkv7-train 240 "$PY" benchmarks/rwkv7.py "${BENCH[@]}" --no-compile --shapes "B8 T4096" --only ropewkv \
            --append
        plan parity 120 "$PY" -m ropewkv parity --device "$DEVICE"  # 51 s after the training rows JIT-compiled Triton
        plan rwkv7-decode 45 "$PY" benchmarks/rwkv7.py "${BENCH[@]}" --no-compile --shapes decode,log_decay --append
        plan host-overhead 20 "$PY" benchmarks/host_overhead.py "${BENCH[@]}"
        # FLA's rows at the training shapes: its autotuning on first use costs minutes per function and shape.
        plan rwkv7-train-fla 240 "$PY" benchmarks/rwkv7.py "${BENCH[@]}" --no-compile --shapes "B8 T4096" \
            --only FLA --append
        # --append: what the steps above measured is kept, the rest (torch.compile, B8 T32) measured.
        plan rwkv7-rest 120 "$PY" benchmarks/rwkv7.py "${BENCH[@]}" --append
        plan rope-rest 90 "$PY" benchmarks/rope.py "${BENCH[@]}" --append
    fi
    for file in ${TESTS:-${GPU_TESTS[*]}}; do
        plan "pytest $file" 120 "$PY" -m pytest -q -p no:cacheprovider --timeout="$TEST_TIMEOUT_S" "$file"
    done
    ;;
sanitize)
    plan build 120 build
    plan sanitize 200 sanitize  # the slowest tool (racecheck) over the 11 tests, the others beside it
    ;;
checks)
    plan build 120 build
    # gpu_checks.sh's limits add to 690 s: its default CHECKS (backtrace,edges: 390 s) fits the ~450 s left on a cold
    # machine; it stops its steps 15 s before this step's limit (STEP_LIMIT_S), so that its summary is written.
    plan checks 520 checks
    ;;
*)
    echo "PLAN must be main, tests, sanitize or checks, got $PLAN" >&2
    exit 2
    ;;
esac

total=0
for budget in "${BUDGETS[@]}"; do total=$((total + budget)); done
{
    echo "## GPU session plan (PLAN=$PLAN, DEVICE=$DEVICE, TOTAL_S=$TOTAL_S, budgets add to ${total}s)"
    echo "work folder (this run's, removed at its end): $WORK"
    for i in "${!NAMES[@]}"; do echo "- ${NAMES[i]}: ${BUDGETS[i]}s"; done
} | tee "$LOG"

SUMMARY=()
STOPPED=""
export -f environment install_wheels build sanitize_one sanitize checks
export SAN_TESTS_LIST="${SAN_TESTS[*]}" EXPECTED_BACKEND
for i in "${!NAMES[@]}"; do
    name=${NAMES[i]}
    if [[ -n ${STEPS:-} && ",$STEPS," != *",$name,"* ]]; then SUMMARY+=("$name: not in STEPS"); continue; fi
    if [[ -n $STOPPED ]]; then SUMMARY+=("$name: not run ($STOPPED)"); continue; fi
    left=$((DEADLINE - SECONDS - 5))
    limit=$((BUDGETS[i] < left ? BUDGETS[i] : left))
    if ((limit < 10)); then SUMMARY+=("$name: skipped (out of time)"); continue; fi
    echo "=== $name (limit ${limit}s): ${COMMANDS[i]}" | tee -a "$LOG"
    start=$SECONDS rc=0
    # bash -c: the steps are functions or commands; --kill-after: a step that ignores SIGTERM is killed 5 s later.
    STEP_LIMIT_S=$limit timeout --kill-after=5 "$limit" bash -c "${COMMANDS[i]}" >>"$LOG" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then status="TIMEOUT at ${limit}s"; elif ((rc)); then status="FAIL (rc $rc)"; else
        status=ok; fi
    result=$(tail -n 3 "$LOG" | grep -E -o '[0-9]+ (passed|failed|skipped|error)[^=]*' | tail -1)
    SUMMARY+=("$name: $status in $((SECONDS - start))s${result:+ ($result)}")
    echo "=== $name: $status" | tee -a "$LOG"
    # No GPU (env's rc 3) or no build: every step after would fail for that one reason.
    if [[ $name == env && $rc == 3 ]] || [[ $name == build && $rc != 0 ]]; then STOPPED="$name failed"; fi
    publish
done

{
    echo
    echo "## GPU session summary ($(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS}s of TOTAL_S=$TOTAL_S, PLAN=$PLAN, DEVICE=$DEVICE)"
    printf -- '- %s\n' "${SUMMARY[@]}"
    grep -h -- '^- .* is [0-9.]*x ' "$WORK"/rope.md "$WORK"/rwkv7.md 2>/dev/null
    if [[ -f $WORK/sanitize.md ]]; then
        sed 's/^- /- sanitizer /' "$WORK/sanitize.md"
    else
        grep -h -E '(ERROR|RACECHECK) SUMMARY' "$LOG" 2>/dev/null | sed 's/^/- sanitizer: /'
    fi
} >"$WORK/summary.md"
cat "$WORK/summary.md" >>"$OUT/results.md"
if [[ $PLAN == checks ]]; then cp "$WORK"/gpu_checks.log "$WORK"/sanitizer_edges.log "$OUT"/ 2>/dev/null; fi
echo "- files in \$OUT ($(ls "$OUT" | wc -l), at most 8 come back): $(ls "$OUT" | tr '\n' ' ')" >>"$WORK/summary.md"
tee -a "$LOG" <"$WORK/summary.md"

"""benchmarks/gpu_session.sh in its CPU dry run (DEVICE=cpu): the plan, the build check, every benchmark and pytest
step, the publishing into at most 8 files and the summary, at tiny sizes, so that the script cannot rot between GPU
sessions. The machine's load decides how long the steps take, so a step may hit its time limit (TIMEOUT, or skipped
out of time); a step that FAILs is a broken script."""
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
CHECKS = os.path.join(ROOT, "benchmarks", "gpu_checks.sh")
TESTS = "tests/test_reference.py tests/test_rope_thread_map.py"  # two of the fastest files: the steps are the point


def dry_run(out, **env) -> tuple:
    """The script in its CPU dry run; an env value None removes that variable."""
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(out), "OMP_NUM_THREADS": "1",
           "BENCH_ARGS": "--quick --no-compile --only ropewkv", "TESTS": TESTS, **env}
    env = {k: v for k, v in env.items() if v is not None and k != "TRITON_INTERPRET"}
    result = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.split("## GPU session summary")[1]
    steps = dict(re.findall(r"^- ([^:]+): (.*)$", summary, flags=re.M))
    return result.stdout, steps


def test_main_plan_runs_every_step_in_order(tmp_path):
    out, steps = dry_run(tmp_path / "out", TOTAL_S="400")
    planned = re.findall(r"^- ([^:]+): \d+s$", out.split("## GPU session plan")[1].split("===")[0], flags=re.M)
    expected = ["env", "wheels", "build", "rope-train", "rwkv7-train", "parity", "rwkv7-decode", "host-overhead",
                "rwkv7-train-fla", "rwkv7-rest", "rope-rest"] + [f"pytest {f}" for f in TESTS.split()]
    assert planned == expected, out
    assert [s for s in steps if s in expected] == expected, steps  # the summary lists every step, in order
    for name in ("env", "wheels", "build", "parity"):
        assert steps[name].startswith("ok"), (name, steps[name], out[-3000:])
    assert not [s for s, status in steps.items() if status.startswith("FAIL")], out[-5000:]
    assert "backends: ['cpu', 'reference']" in (tmp_path / "out" / "session.log").read_text()
    files = os.listdir(tmp_path / "out")
    assert {"session.log", "results.md"} <= set(files) and len(files) <= 8, files
    results = (tmp_path / "out" / "results.md").read_text()
    assert "## RWKV-7" in results or "## rwkv7: cut short" in results, results
    assert "## GPU session summary" in results


def test_sanitize_plan_names_tests_that_exist(tmp_path):
    """The dry run runs the sanitizer's named tests without the tool: a renamed test fails here, not on the GPU.
    SAN_TOOLS picks the tools (one here: the tests are the same for each), and each gets its own summary line."""
    with open(SCRIPT) as f:
        named = re.search(r"^SAN_TESTS=\((.*?)^\)", f.read(), flags=re.M | re.S).group(1)
    count = len(re.findall(r'^\s*"tests/', named, flags=re.M))
    out, steps = dry_run(tmp_path / "out", PLAN="sanitize", SAN_TOOLS="memcheck", STEPS="env,build,sanitize",
                         TOTAL_S="300")
    assert count >= 11 and steps["sanitize"].startswith("ok") and f"{count} passed" in steps["sanitize"], out[-3000:]
    assert steps["sanitizer memcheck"].startswith(f"ok; {count} passed"), steps
    assert not [s for s in steps if s.startswith("sanitizer ") and s != "sanitizer memcheck"], steps
    assert "--- memcheck" in (tmp_path / "out" / "session.log").read_text()  # the tool's log, appended


def test_a_dry_run_leaves_other_runs_work_folders_alone(tmp_path):
    """Each run works in a folder of its own: a dry run inside a GPU session (this file, run by the session's pytest
    step) once wiped the session's fixed build/gpu-session/work, and its CPU rows were then published as GPU rows. The
    session exports WORK, so an inherited WORK must not be used either."""
    inherited = tmp_path / "session-work"
    inherited.mkdir()
    (inherited / "marker").write_text("the session's")
    shared = os.path.join(ROOT, "build", "gpu-session", "work")  # the folder every run shared before
    made = not os.path.isdir(shared)
    os.makedirs(shared, exist_ok=True)
    marker = os.path.join(shared, f"marker-{os.getpid()}")
    with open(marker, "w") as f:
        f.write("another run's")
    try:
        out, steps = dry_run(tmp_path / "out", STEPS="none", WORK=str(inherited))
        assert os.path.exists(marker), "the dry run removed another run's work folder"
    finally:
        if os.path.exists(marker):
            os.remove(marker)
        if made and not os.listdir(shared):
            os.rmdir(shared)
    assert os.listdir(inherited) == ["marker"]
    work = re.search(r"^work folder \(this run's, removed at its end\): (.*)$", out, flags=re.M).group(1)
    assert work not in (str(inherited), shared) and not os.path.exists(work), work
    assert steps["env"] == "not in STEPS", steps


def test_default_tests_are_the_files_that_run_on_a_gpu(tmp_path):
    """Without TESTS, the pytest steps are the files that run something on a CUDA device when one is present; the
    host-only files (emulators of the CUDA kernels on the host, compile-only checks, CPU benchmarks, these scripts'
    own tests) would spend the call's minutes for nothing."""
    out, _ = dry_run(tmp_path / "out", STEPS="none", TESTS=None)
    planned = re.findall(r"^- pytest (\S+): \d+s$", out.split("## GPU session plan")[1].split("===")[0], flags=re.M)
    host_only = ["tests/test_benchmarks.py", "tests/test_gpu_session.py", "tests/test_setup_venv.py",
                 "tests/test_static_report.py", "tests/test_triton_compile.py", "tests/test_distributed.py",
                 "tests/test_rope_thread_map.py", "tests/test_wkv7_step_lanes.py", "tests/test_cuda_block_on_host.py",
                 "tests/test_mma_bf16_on_host.py", "tests/test_rope_cuda_on_host.py",
                 "tests/test_wkv7_chunked_cuda_on_host.py", "tests/test_wkv7_cuda_on_host.py"]
    gpu = ["tests/test_rope.py", "tests/test_wkv7.py", "tests/test_wkv7_chunked.py", "tests/test_decay.py",
           "tests/test_qk_norm_rope.py", "tests/test_bad_input.py", "tests/test_fuzz.py", "tests/test_determinism.py",
           "tests/test_compat_fla.py", "tests/test_compat_serving.py", "tests/test_patch_transformers.py",
           "tests/test_hub_kernels.py", "tests/test_nn_rwkv7.py", "tests/test_demo.py", "tests/gpu_edge_cases.py"]
    assert not set(host_only) & set(planned), planned
    assert set(gpu) <= set(planned), planned
    assert len(planned) == len(set(planned)) and all(os.path.exists(os.path.join(ROOT, f)) for f in planned)
    # Every test file is in one list or the other (a new one must be placed), and one that takes the `device`
    # fixture (the GPU there) or asks for the best device is in the GPU list.
    with open(SCRIPT) as f:
        host = re.search(r"^HOST_TESTS=\((.*?)^\)", f.read(), flags=re.M | re.S).group(1).split()
    files = sorted(f"tests/{n}" for n in os.listdir(os.path.join(ROOT, "tests")) if re.match(r"test_.*\.py$", n))
    assert sorted(set(planned) - {"tests/gpu_edge_cases.py"} | set(host)) == files
    assert not set(host) & set(planned)
    for name in files:
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        if re.search(r"^def test_\w*\([^)]*\bdevice\b|\bbest_device\(\)", source, flags=re.M):
            assert name in planned, f"{name} runs on the best device but is not in GPU_TESTS"


def checks_plan(**env) -> str:
    env = {**os.environ, "PLAN_ONLY": "1", "PYTHON": sys.executable, **env}
    env = {k: v for k, v in env.items() if v is not None}
    result = subprocess.run(["bash", CHECKS], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def collected(*args) -> list:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_checks_sanitizers_run_collected_cuda_cases_only(tmp_path):
    """compute-sanitizer over gpu_checks.sh's SAN_IDS: each id is collected, and each is a CUDA-backend case (racecheck
    flags Triton's own tl.sum reductions, triton-lang/triton#7264, and CPU cases give the tools nothing to watch)."""
    out = checks_plan(OUT=str(tmp_path), CHECKS=None, CHECKS_TOTAL_S=None, STEP_LIMIT_S=None)
    ids = out.split("## sanitizer test ids\n")[1].split("##")[0].split()
    assert len(ids) >= 20 and len(set(ids)) == len(ids), ids
    assert set(ids) <= set(collected(*ids)), "an id the sanitizers name is not collected"
    for node in ids:
        params = re.findall(r"[^-\[\]]+", node.partition("[")[2])
        assert "triton" not in node and "cpu" not in node and "past_2_31" not in node, node
        assert "cuda" in params or node.split("::")[1].startswith("test_cuda_"), f"{node}: not a CUDA-only case"


def test_checks_sanitizers_dry_run(tmp_path):
    """gpu_checks.sh's CPU dry run of two sanitizer steps at once (the tests without the tool; the CUDA ones skip
    here): the ids run, each tool gets its line in sanitizer_edges.log, and the summary is written."""
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path), "CHECKS": "memcheck,racecheck",
           "OMP_NUM_THREADS": "1"}
    env.pop("STEP_LIMIT_S", None)
    result = subprocess.run(["bash", CHECKS], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "- failed steps: none" in result.stdout, result.stdout
    sanlog = (tmp_path / "sanitizer_edges.log").read_text()
    for tool in ("memcheck", "racecheck"):
        assert re.search(rf"^sanitizer {tool}: ok; \d+ skipped", sanlog, flags=re.M), sanlog[-3000:]
    assert "sanitizer initcheck" not in sanlog and sorted(os.listdir(tmp_path)) == ["gpu_checks.log",
                                                                                    "sanitizer_edges.log"]


def test_checks_plan_runs_the_backtrace_first_and_fits_its_call(tmp_path):
    """gpu_checks.sh's steps in priority order, the backtrace (NOTES: the segfault of test_wkv7.py) first; its default
    CHECKS fits what PLAN=checks leaves of a cold call, and the other steps fit a second, warm one; the backtrace gets
    the file's tests up to and including the crashing one, and time for them under cuda-gdb."""
    out = checks_plan(OUT=str(tmp_path), CHECKS=None, CHECKS_TOTAL_S=None, STEP_LIMIT_S=None)
    plan = re.findall(r"^- (\w+): (\d+)s( \(not in CHECKS\))?$", out, flags=re.M)
    assert [name for name, _, _ in plan] == ["backtrace", "edges", "reliability", "sanitizers"], out
    default = sum(int(limit) for _, limit, skipped in plan if not skipped)
    rest = sum(int(limit) for _, limit, skipped in plan if skipped)
    assert not plan[0][2], "the backtrace is not in the default CHECKS"
    # gpu_session.sh's TOTAL_S (540) less env (~10 s on the H100/H200), the build from scratch (~60 s), its 5 s
    # margin and the 15 s gpu_checks.sh keeps for its summary; 30 s more to spare. A warm call rebuilds nothing.
    assert default <= 540 - 10 - 60 - 5 - 15 - 30, out
    assert rest <= 540 - 10 - 5 - 15 - 30, out
    # test_wkv7.py ran 53 s natively before the segfault; cuda-gdb gets the step's limit less 60 s.
    assert int(plan[0][1]) - 60 >= 2 * 53, out
    ids = out.split("## backtrace test ids\n")[1].split()
    wkv7 = collected("tests/test_wkv7.py")
    assert len(ids) > 1 and ids == wkv7[:len(ids)], ids
    assert "::test_cpp_guards_behind_python" in ids[-1] and all("cpp_guards" not in i for i in wkv7[len(ids):])
    # The documented commands name the steps they want.
    for doc in ("README.md", "benchmarks/results/README.md", "benchmarks/gpu_session.sh"):
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for command in re.findall(r"`[^`]*PLAN=checks[^`]*`|\"[^\"]*PLAN=checks[^\"]*\"", text):
            assert "CHECKS=" in command, (doc, command)


def test_results_say_cut_short_when_the_json_does(tmp_path):
    """A benchmark writes its .md only when it finishes, its JSON after every row ("complete": false until then): a
    step cut short after an earlier step of the same benchmark finished leaves that earlier table behind, which
    results.md must not pass off as the result. PYTHON is a stand-in that plays both steps of rwkv7.py at once."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys, time
        args = sys.argv[1:]
        if args[:1] == ["benchmarks/rwkv7.py"]:
            out = args[args.index("--out") + 1]
            if "--shapes" in args:  # rwkv7-decode: finishes, its table written
                with open(os.path.join(out, "rwkv7.md"), "w") as f:
                    f.write("## RWKV-7 STALE TABLE\\n")
                with open(os.path.join(out, "rwkv7.json"), "w") as f:
                    json.dump({{"complete": True, "rows": [1]}}, f, indent=1)
                sys.exit(0)
            with open(os.path.join(out, "rwkv7.json"), "w") as f:  # rwkv7-rest: one more row, then cut off
                json.dump({{"complete": False, "rows": [1, 2]}}, f, indent=1)
            time.sleep(600)
        os.execv(sys.executable, [sys.executable, *args])
        """))
    fake.chmod(0o755)
    out, steps = dry_run(tmp_path / "out", PYTHON=str(fake), STEPS="rwkv7-decode,rwkv7-rest", TOTAL_S="25", PLOT="0")
    assert steps["rwkv7-decode"].startswith("ok") and steps["rwkv7-rest"].startswith("TIMEOUT"), steps
    results = (tmp_path / "out" / "results.md").read_text()
    assert "## rwkv7: cut short, its rows so far are in rwkv7.json" in results, results
    assert results.index("cut short") < results.index("STALE TABLE"), results
    assert '"complete": false' in (tmp_path / "out" / "rwkv7.json").read_text()

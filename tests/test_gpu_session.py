"""benchmarks/gpu_session.sh in its CPU dry run (DEVICE=cpu): the plan, the build check, every benchmark and pytest
step, the publishing into at most 8 files and the summary, at tiny sizes, so that the script cannot rot between GPU
sessions. The machine's load decides how long the steps take, so a step may hit its time limit (TIMEOUT, or skipped
out of time); a step that FAILs is a broken script."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
TESTS = "tests/test_reference.py tests/test_rope_thread_map.py"  # two of the fastest files: the steps are the point


def dry_run(out, **env) -> tuple:
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(out), "OMP_NUM_THREADS": "1",
           "BENCH_ARGS": "--quick --no-compile --only ropewkv", "TESTS": TESTS, **env}
    env.pop("TRITON_INTERPRET", None)
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

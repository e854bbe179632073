"""tools/setup_venv.sh decides as the GPU machine needs: a python that has torch is reused, with no network.

The stand-in for the GPU machine's /opt/torch/.venv/bin/python3 is the python running these tests: a venv's python with
torch and every package of the setup installed (make test's setup put them there). pip gets no index and no local
wheels, so any install attempt fails the test.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "setup_venv.sh")


def offline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, **extra}


def setup(*args, **env) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=offline_env(**env),
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def wrapper(directory, name: str, python: str) -> None:
    """An executable `name` that runs `python` (a symlink would lose the venv: python finds pyvenv.cfg beside its
    own path)."""
    path = directory / name
    path.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    path.chmod(0o755)


def test_a_python_with_torch_is_reused_offline(tmp_path):
    venv = tmp_path / "venv"
    out = setup(str(venv), sys.executable).stdout
    assert f"setup: reuse the torch of {sys.executable} ({torch.__version__})" in out, out
    assert "installing" not in out, out
    probe = ("import torch, triton, numpy, pytest, pytest_timeout, hypothesis, transformers, matplotlib, ninja, wheel;"
             "print(torch.__file__)")
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == torch.__file__  # the parent's torch itself, not a copy
    # Run again on the existing venv: still nothing to install.
    assert "installing" not in setup(str(venv)).stdout


def test_the_python_that_has_torch_is_picked_from_the_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper(bin_dir, "python3", sys.executable)
    out = setup("--plan", str(tmp_path / "venv"), PATH=f"{bin_dir}:{os.environ['PATH']}").stdout
    assert f"setup: reuse the torch of {bin_dir / 'python3'}" in out, out
    assert out.split("would install:")[1].splitlines()[0].split() == [], out


def test_a_python_without_torch_gets_the_pinned_torch(tmp_path):
    bare = tmp_path / "bare"  # a venv without system site packages: pip, and no torch
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=300)
    out = setup("--plan", str(tmp_path / "venv"), str(bare / "bin" / "python")).stdout
    assert "setup: new venv from" in out, out
    plan = out.split("would install:")[1].splitlines()[0].split()
    assert "torch==2.13.0" in plan and "triton==3.7.1" in plan and "matplotlib" in plan, out


def python_without_ensurepip(tmp_path) -> str:
    """A stand-in for the GPU machine's python: Ubuntu's python3.12 without python3.12-venv (so without ensurepip, and
    no network to fetch it), under /opt/torch/.venv with torch. Here: a copy of this interpreter's base executable
    beside a standard library of links to the real one's entries, ensurepip left out; then a venv of that (with
    --without-pip, the only way there) that sees the packages of the venv running these tests through a .pth file."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = sysconfig.get_paths()["stdlib"]  # the base interpreter's, also from inside a venv
    base = tmp_path / "base"
    lib = base / "lib" / version
    lib.mkdir(parents=True)
    for entry in os.listdir(stdlib):
        if entry not in ("ensurepip", "site-packages", "dist-packages"):
            (lib / entry).symlink_to(os.path.join(stdlib, entry))
    for shared in glob.glob(os.path.join(sys.base_prefix, "lib", "libpython*")):  # a libpython found via $ORIGIN
        (base / "lib" / os.path.basename(shared)).symlink_to(shared)
    (base / "bin").mkdir()
    exe = base / "bin" / version
    shutil.copy2(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), exe)
    probe = subprocess.run([str(exe), "-c", "import sys; print(sys.prefix); import ensurepip"], capture_output=True,
                           text=True, timeout=120)
    if probe.stdout.strip() != str(base) or "No module named 'ensurepip'" not in probe.stderr:
        pytest.skip(f"cannot make a python without ensurepip from {sys.base_prefix}: {probe.stdout} {probe.stderr}")
    parent = tmp_path / "parent"
    subprocess.run([str(exe), "-m", "venv", "--without-pip", str(parent)], check=True, timeout=300)
    parent_site = subprocess.run([str(parent / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    with open(os.path.join(parent_site, "tests_venv.pth"), "w") as pth:
        pth.write(f"import site; site.addsitedir({ours!r})\n")
    return str(parent / "bin" / "python")


def test_a_python_without_ensurepip_is_reused_without_pip_of_its_own(tmp_path):
    """`python -m venv` needs ensurepip for the venv's own pip; without it the venv is made --without-pip, and the
    parent's pip (through its site-packages) does what pip is needed for."""
    python = python_without_ensurepip(tmp_path)
    venv = tmp_path / "venv"
    out = setup(str(venv), python).stdout
    assert f"setup: reuse the torch of {python}" in out and "has no ensurepip" in out, out
    assert "installing" not in out, out
    assert not (venv / "bin" / "pip").exists()
    probe = "import torch, pip, pytest, numpy; print(torch.__file__)"
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == torch.__file__
    assert "installing" not in setup(str(venv)).stdout  # again, on the existing venv

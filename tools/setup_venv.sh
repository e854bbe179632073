#!/usr/bin/env bash
# Creates the project's venv if missing, then installs the PACKAGES that are not satisfied yet (none: pip never runs).
#   tools/setup_venv.sh [--plan] VENV [PYTHON]
# The python: PYTHON if given, else the first of python3, python3.12, python3.11 on the PATH that already imports torch,
# else python3.11, else python3.
# - A python that has torch (the GPU machines: /opt/torch/.venv/bin/python3, with no network) is reused: the venv sees
#   its packages, and its torch and triton are never replaced. `venv --system-site-packages` alone shows only the base
#   interpreter's packages when that python is itself a venv, so its site-packages are added with a .pth file.
# - Otherwise torch 2.13.0 is installed (the CPU wheel on disk on the dev and CI machines).
# --plan prints the decision and what would be installed, and changes nothing (tests/test_setup_venv.py).
set -euo pipefail

# One requirement a line; a branch that needs another package adds one line.
PACKAGES=(
  torch==2.13.0  # matched by name alone where the python already has torch
  triton==3.7.1  # the version torch 2.13's CUDA build pins; likewise matched by name alone next to a found torch
  "setuptools>=64"
  wheel  # setuptools < 70.1 builds editable installs only with it (else "invalid command 'bdist_wheel'")
  ninja
  numpy
  pytest
  pytest-timeout
  hypothesis
  transformers
  matplotlib  # make demo's plot
)
PEERS=(
  kernels==0.17.2  # HF's kernel hub (tests/test_hub_kernels.py)
  flash-linear-attention==0.6.0  # with fla-core 0.6.0 and einops: FLA's RWKV-7 kernels and layers (tests/fla_cpu.py)
)

plan=0
if [[ ${1:-} == --plan ]]; then plan=1; shift; fi
venv=${1:?usage: setup_venv.sh [--plan] VENV [PYTHON]}
python=${2:-}

has_torch() { "$1" -c "import torch" 2>/dev/null; }

if [[ -z $python ]]; then
  for candidate in python3 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && has_torch "$candidate"; then python=$(command -v "$candidate"); break; fi
  done
  python=${python:-$(command -v python3.11 || command -v python3)}
fi

if [[ -x $venv/bin/python ]]; then
  mode="existing venv $venv"
elif has_torch "$python"; then
  mode="reuse the torch of $python ($("$python" -c 'import torch; print(torch.__version__)'))"
else
  mode="new venv from $python, torch installed"
fi
echo "setup: $mode"

# Requirements not yet satisfied, as the venv's python (or, for --plan before it exists, the chosen one) sees them.
missing() {
  local reuse=$1 py=$2
  shift 2
  "$py" - "$reuse" "$@" <<'EOF'
import sys
from importlib import metadata

try:
    from pip._vendor.packaging.requirements import Requirement
except ImportError:  # no pip importable here (a venv without one): packaging itself, where installed
    from packaging.requirements import Requirement

reuse = sys.argv[1] == "1"
for line in sys.argv[2:]:
    requirement = Requirement(line)
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        print(line)
        continue
    keep = reuse and requirement.name in ("torch", "triton")
    if not keep and not requirement.specifier.contains(version, prereleases=True):
        print(line)
EOF
}

reuse=0
if [[ $mode == reuse* ]] || { [[ $mode == existing* ]] && [[ -f $venv/.ropewkv-reuses-torch ]]; }; then reuse=1; fi

if ((plan)); then
  py=$python
  [[ -x $venv/bin/python ]] && py=$venv/bin/python
  echo "setup: would install: $(missing "$reuse" "$py" "${PACKAGES[@]}" | tr '\n' ' ')"
  echo "setup: would try the peers: $(missing 0 "$py" "${PEERS[@]}" | tr '\n' ' ')"
  exit 0
fi

# `venv` installs pip with ensurepip, which Debian and Ubuntu ship apart (python3.X-venv): the GPU machines' Ubuntu
# python may lack it, and has no network to get it. Without it the venv gets no pip of its own: reusing a python, the
# parent's pip stays importable through the parent's site-packages, and every pip below runs as `python -m pip`.
if [[ ! -x $venv/bin/python ]]; then
  venv_args=()
  if ! "$python" -c "import ensurepip" 2>/dev/null; then
    venv_args=(--without-pip)
    echo "setup: $python has no ensurepip (Debian/Ubuntu: the python3.X-venv package): the venv gets no pip of its own"
  fi
  if ((reuse)); then
    "$python" -m venv --system-site-packages "${venv_args[@]}" "$venv"
    # The found python's own site-packages, .pth files included, when it is itself a venv.
    "$python" - "$venv" <<'EOF'
import os, subprocess, sys, sysconfig

if sys.prefix != sys.base_prefix:
    venv_site = subprocess.check_output([os.path.join(sys.argv[1], "bin", "python"), "-c",
                                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
    dirs = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    with open(os.path.join(venv_site.strip(), "_ropewkv_parent_site.pth"), "w") as pth:
        pth.writelines(f"import site; site.addsitedir({d!r})\n" for d in dirs)
EOF
    touch "$venv/.ropewkv-reuses-torch"
  else
    "$python" -m venv "${venv_args[@]}" "$venv"
    if ((${#venv_args[@]})); then
      # A venv of its own needs a pip of its own: the parent's pip installs one into it (pip >= 22.3: --python).
      "$python" -m pip --python "$venv/bin/python" install -q pip || {
        echo "setup: no pip for $venv: install python3.X-venv, or name a python with pip or torch" >&2
        exit 1
      }
    fi
  fi
fi

# $(...), not <(...): a missing() that fails (neither pip nor packaging importable) stops the script (set -e) instead of
# reading as "nothing to install".
list=$(missing "$reuse" "$venv/bin/python" "${PACKAGES[@]}")
mapfile -t install < <(grep . <<<"$list" || true)
if ((${#install[@]})); then
  echo "setup: installing ${install[*]}"
  "$venv/bin/python" -m pip install -q "${install[@]}"
fi
# The peers the tests run against (pure Python). Where no index is reachable (the GPU machines) they may be missing:
# the tests against them then skip, saying why.
list=$(missing 0 "$venv/bin/python" "${PEERS[@]}")
mapfile -t peers < <(grep . <<<"$list" || true)
if ((${#peers[@]})) && ! "$venv/bin/python" -m pip install -q --retries 0 --timeout 15 "${peers[@]}"; then
  echo "setup: could not install ${peers[*]}: the tests against them skip"
fi

#!/usr/bin/env bash
# Creates the project's .venv if missing. Where the base Python already has torch (the GPU machines, which have no
# network) the venv reuses it; elsewhere it installs torch 2.13.0 (the CPU wheel on disk on our dev/CI machines).
# Then installs each tool that is not importable yet, so a machine without network installs nothing.
set -euo pipefail
python=${1:?usage: setup_venv.sh PYTHON VENV}
venv=${2:?usage: setup_venv.sh PYTHON VENV}

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the torch of $python ($("$python" -c 'import torch; print(torch.__version__)'))"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
  fi
fi

# module:requirement pairs; triton pinned to the version torch 2.13's CUDA build pins.
for pair in torch:torch==2.13.0 triton:triton==3.7.1 ninja:ninja pytest:pytest numpy:numpy hypothesis:hypothesis \
            transformers:transformers kernels:kernels==0.17.2 fla:flash-linear-attention==0.6.0; do
  module=${pair%%:*}
  requirement=${pair#*:}
  if ! "$venv/bin/python" -c "import $module" 2>/dev/null; then
    "$venv/bin/pip" install -q "$requirement"
  fi
done

#!/usr/bin/env bash
# Download the peers' pure-Python wheels (python 3.12, x86-64) into .whl/ for the GPU machine, which has no network.
# Run here, from the repo root: benchmarks/fetch_peer_wheels.sh. Then carry ".whl" in the device call; gpu_session.sh
# installs them with --no-index --no-deps into /tmp/site.
#
# Peers and their needs (Requires-Dist, extras skipped), against the GPU image's package list (KINDS.md):
#   liger-kernel           -> torch, triton: both in the image.
#   flash-linear-attention -> fla-core (== same version; fla-core holds fla.ops, incl. fla.ops.rwkv7) and
#                             transformers >= 5.6.2 (the image has 5.17). fla-core -> einops (in the image).
#   flash-attn             -> no pure-Python wheel (a compiled CUDA package): not fetched. Its Triton rotary
#                             (flash_attn.ops.triton.rotary) is one file, but importing it runs flash_attn/__init__,
#                             which loads the compiled extension, so the benchmark reports it as n/a.
# Pinned so that a session is reproducible; bump deliberately. Keep one version of each (two break the install).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}"
for wheel in .whl/*.whl; do
    needs=$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
            | sed 's/Requires-Dist: //' | paste -sd, -)
    printf '%-55s %6s KB  needs: %s\n' "$(basename "$wheel")" "$(( $(stat -c %s "$wheel") / 1024 ))" "${needs:-nothing}"
done
du -sh .whl | awk '{print "total " $1 " in .whl/ (the device call carries at most 64 MiB with the tree)"}'

#!/usr/bin/env bash
# Prints a content hash of what the extensions are built from: csrc/, setup.py and the build switches. A rebuild is
# due exactly when it changes (mtimes are no guide: copying the tree to another machine refreshes them).
# `make build` and benchmarks/gpu_session.sh write it to build/source.hash after a build.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  find csrc setup.py -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  env | grep -E '^(ROPEWKV_ACCUM|ROPEWKV_CPU_ARCH|ROPEWKV_CUDA|TORCH_CUDA_ARCH_LIST)=' | LC_ALL=C sort || true
} | sha256sum | cut -c1-16

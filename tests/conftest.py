import os

import torch

import pytest  # noqa: E402

# A run meant for a GPU (make test where nvidia-smi sees one, benchmarks/gpu_session.sh) that torch cannot reach would
# otherwise fall back to the interpreter and fail everywhere for the wrong reason.
if os.environ.get("ROPEWKV_EXPECT_GPU") == "1" and not torch.cuda.is_available():
    pytest.exit(f"ROPEWKV_EXPECT_GPU=1 but torch {torch.__version__} sees no CUDA device "
                f"(torch.version.cuda={torch.version.cuda}): check nvidia-smi and the driver", returncode=3)

# Triton reads TRITON_INTERPRET when @triton.jit decorates, so set it before any ropewkv kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ropewkv  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The best device present: the kernels' parity tests run there (cuda+triton on a GPU, cpu+triton here)."""
    return ropewkv._backend.best_device()


def kernel_backends(device) -> list:
    """Every kernel twin that can run on `device` (the eager reference is the oracle, not a twin)."""
    return [b for b in ropewkv.available_backends(device) if b != "reference"]


def pytest_runtest_logreport(report):
    """ROPEWKV_FAILURES_NOW=1 (benchmarks/gpu_session.sh): each failure is printed as it happens, so that a crash later
    in the file (a segfault ends pytest before its summary, as on the H200 on 2026-11-26) cannot hide which tests
    failed and why."""
    if os.environ.get("ROPEWKV_FAILURES_NOW") == "1" and report.failed:
        print(f"\nFAILED NOW {report.nodeid} ({report.when}):\n{report.longreprtext[-3000:]}", flush=True)

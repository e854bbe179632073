import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit decorates, so set it before any ropewkv kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ropewkv  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The best device present: the kernels' parity tests run there (cuda+triton on a GPU, cpu+triton here)."""
    return ropewkv._backend.best_device()


def kernel_backends(device) -> list:
    """Every kernel twin that can run on `device` (the eager reference is the oracle, not a twin)."""
    return [b for b in ropewkv.available_backends(device) if b != "reference"]

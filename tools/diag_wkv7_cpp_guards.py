"""Isolates the segfault of tests/test_wkv7.py::test_cpp_guards_behind_python seen on the GPU machine (torch 2.11).

Each C++ guard of ropewkv._C's wkv7_forward runs in a fresh process, so one crash does not hide the others:
  decay  "decay must be 0 ..."                   a throw whose message holds only numbers
  state  "initial_state must have shape ..."     a throw whose message holds sizes
  cu     "cu_seqlens must start at 0 ..."        a throw whose message prints a tensor (at::print)
A crash here in a fresh process means the throw path itself; all clean here but a crash in the full test file means
state left by earlier tests (bisect with pytest -k). Each case runs twice: as the package loads, and with
ropewkv._C_cuda kept from loading (a crash only with it: the CUDA extension's presence is the cause). Only the "cu"
case crashing: the tensor streamed into its message. Not reproduced on the dev machine with torch 2.11.0+cu130, both
extensions built, Python 3.11 and 3.12, nor under ASan (2026-11-26).
Usage: python3 tools/diag_wkv7_cpp_guards.py [decay|state|cu [--without-cuda-extension]]
A native backtrace of the crash in the test file (gdb, or cuda-gdb, which debugs host code too):
  gdb -batch -ex 'set pagination off' -ex run -ex bt -ex 'info sharedlibrary' -ex 'x/8i $pc' \
      --args python3 -m pytest -q -p no:cacheprovider -p no:faulthandler -x tests/test_wkv7.py
"""
import faulthandler
import subprocess
import sys

CASES = ("decay", "state", "cu")


def run_case(name, without_cuda_extension=False):
    if without_cuda_extension:
        sys.modules["ropewkv._C_cuda"] = None  # its import then fails, as where it was not built
    import torch

    import ropewkv  # noqa: F401  (registers torch.ops.ropewkv from ropewkv._C)

    xs = [torch.randn(1, 4, 1, 32) for _ in range(6)]
    args, expected = {
        "decay": ((None, None, 7, 0, False), "decay must be 0"),
        "state": ((torch.zeros(2, 1, 32, 32), None, 0, 0, False), "initial_state must have shape"),
        "cu": ((None, torch.tensor([0, 9]), 0, 0, False), "cu_seqlens must start at 0"),
    }[name]
    try:
        torch.ops.ropewkv.wkv7_forward(*xs, *args)
    except ValueError as error:
        assert expected in str(error), str(error)
        print(f"{name}: ValueError as expected (torch {torch.__version__})")
        return
    raise SystemExit(f"{name}: no error raised")


if __name__ == "__main__":
    faulthandler.enable()
    if len(sys.argv) > 1:
        run_case(sys.argv[1], "--without-cuda-extension" in sys.argv[2:])
    else:
        codes = {f"{name}{extra}": subprocess.run([sys.executable, __file__, name, *extra.split()]).returncode
                 for name in CASES for extra in ("", " --without-cuda-extension")}
        print("return codes (negative: killed by that signal, -11 = SIGSEGV):", codes)
        sys.exit(any(codes.values()))

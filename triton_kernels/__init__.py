"""Triton twins of the ropewkv kernels (installed as `ropewkv.triton_kernels`).

Import these modules only after TRITON_INTERPRET is set: Triton reads it when @triton.jit decorates a function.
"""

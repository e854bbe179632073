"""Op layer: custom-op registration (C++ schemas from _C, Triton ops here), fake kernels, autograd, public calls."""

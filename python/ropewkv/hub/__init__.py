"""The third way to swap ropewkv in: HF transformers' own kernel mechanism (the `kernels` library's kernelize, as
`model.set_use_kernels(True)` / `from_pretrained(..., use_kernels=True)` run it) picks ropewkv for `rotary_pos_emb`,
the name under which HF registers apply_rotary_pos_emb (`@use_kernel_forward_from_hub("rotary_pos_emb")`).

REPO_PATH is a local kernel repository inside this package (rotary/: metadata.json, an `__init__` exporting `layers`);
kernel_mapping() maps `rotary_pos_emb` to its layer for CPU and CUDA, every kernelize mode, for
`kernels.register_kernel_mapping` / `use_kernel_mapping`. HF builds cos/sin in the model dtype before it calls the
layer, so this route computes in fp32 on HF's tables; ropewkv.patch.transformers also swaps the tables for exact ones.
Not every function registered under that name is HF's rotate_half RoPE (GPT-OSS's is not): the layer probes each once
and runs HF's own function where the probe fails (rotary/layers.py).
"""
from __future__ import annotations

from pathlib import Path

REPO_PATH = Path(__file__).resolve().parent / "rotary"
LAYER_NAME = "ApplyRotaryPosEmb"
HF_LAYER = "rotary_pos_emb"
# CUDA devices our twins are built for (sm_80 and newer). A narrower capability range than HF's own default entry
# (all capabilities) wins kernelize's lookup, which prefers the most specific range.
MIN_CUDA_CAPABILITY = 80


def kernel_mapping(devices=("cpu", "cuda")) -> dict:
    """{"rotary_pos_emb": {device: {mode: LocalLayerRepository}}} for `kernels.register_kernel_mapping` (or
    `use_kernel_mapping`): ropewkv's layer in inference and training, with and without torch.compile."""
    import sys

    from kernels import CUDAProperties, Device, LocalLayerRepository, Mode

    repo = LocalLayerRepository(repo_path=REPO_PATH, layer_name=LAYER_NAME)
    modes = {mode: repo for mode in (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE,
                                     Mode.TRAINING | Mode.TORCH_COMPILE)}
    mapping = {}
    for device in devices:
        if device == "cuda":
            device = Device(type="cuda", properties=CUDAProperties(min_capability=MIN_CUDA_CAPABILITY,
                                                                   max_capability=sys.maxsize))
        elif device != "cpu":
            raise ValueError(f"devices must be 'cpu' and/or 'cuda' (ropewkv's twins), got {device!r}")
        mapping[device] = dict(modes)
    return {HF_LAYER: mapping}


def kernel_config():
    """A transformers KernelConfig selecting ropewkv's local layer for `rotary_pos_emb` (HF's KernelConfig takes
    accelerator devices only; on CPU register kernel_mapping() instead)."""
    from transformers import KernelConfig

    return KernelConfig({HF_LAYER: f"{REPO_PATH}:{LAYER_NAME}"}, use_local_kernel=True)


__all__ = ["HF_LAYER", "LAYER_NAME", "REPO_PATH", "kernel_config", "kernel_mapping"]

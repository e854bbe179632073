"""Benchmarks of the ropewkv ops against eager PyTorch, torch.compile and the field (see NOTES.md)."""

"""The eager backend: the PyTorch reference of docs/arithmetic.md (cpu and cuda)."""

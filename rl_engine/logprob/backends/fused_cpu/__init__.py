"""The fused CPU backend: the eager backend's bytes from a compiled one-pass C kernel."""

"""The Triton backend: the eager backend's bytes from Triton kernels (cuda; its interpreter on cpu)."""

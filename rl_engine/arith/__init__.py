"""The arithmetic of docs/arithmetic.md in its reference implementations.

NumPy (``spec_numpy``), the temperature's ``T32`` (``temperature``), the GPU's division by it in
NumPy (``division``), and the portable PyTorch pieces the eager backend runs (``portable``,
``tiles``). Empty, so that the NumPy modules import without torch.
"""

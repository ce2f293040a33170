"""weft.kernels: Triton kernels and their PyTorch references."""

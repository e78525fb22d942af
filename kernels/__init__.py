"""Triton kernels. Import the submodules directly (attention, fused_ops); importing this package loads no triton."""

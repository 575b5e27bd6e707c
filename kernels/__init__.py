"""Triton kernels with pure-torch references, importable as ``spmd_rlhf.kernels``."""

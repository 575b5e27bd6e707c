"""spmd_rlhf: RLHF in the HybridFlow design on PyTorch alone (torchrun, DeviceMesh, DTensor, FSDP2)."""

__version__ = "0.1.0"

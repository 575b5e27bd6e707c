"""The 3D-HybridEngine: the actor trains in one parallel layout and generates in another on the same ranks."""

from spmd_rlhf.hybrid.hybrid_engine import HybridEngine
from spmd_rlhf.hybrid.layout import GenerationLayout

__all__ = ["GenerationLayout", "HybridEngine"]

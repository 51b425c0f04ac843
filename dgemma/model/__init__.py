"""The DiffusionGemma text model: shared layers run as a causal encoder or a bidirectional decoder."""

from dgemma.model.diffusion_gemma import DiffusionGemma

__all__ = ["DiffusionGemma"]

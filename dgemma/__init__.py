"""dgemma: run, serve and fine-tune DiffusionGemma block-diffusion language models."""

from dgemma.api import Model, Result, StreamEvent, load

__version__ = "0.1.0"
__all__ = ["Model", "Result", "StreamEvent", "load", "__version__"]

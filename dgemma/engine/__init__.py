"""Engine: requests, the block-diffusion scheduler, and autoregressive decoding of the same weights."""

from dgemma.engine.engine import Engine
from dgemma.engine.request import Event, Request, Stats

__all__ = ["Engine", "Event", "Request", "Stats"]

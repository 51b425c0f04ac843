"""Engine: requests, the continuous-batching block-diffusion engine, the reference engine, autoregressive
and speculative decoding of the same weights, and the one adaptor from engine events to text."""

from dgemma.cache import PrefixCache
from dgemma.engine.autoregressive import AutoregressiveEngine
from dgemma.engine.engine import Engine
from dgemma.engine.output import OutputStream, Result, StreamEvent
from dgemma.engine.reference import ReferenceEngine
from dgemma.engine.request import Event, Request, Stats
from dgemma.engine.speculative import SpeculativeEngine

__all__ = ["AutoregressiveEngine", "Engine", "Event", "OutputStream", "PrefixCache", "ReferenceEngine", "Request",
           "Result", "SpeculativeEngine", "Stats", "StreamEvent"]

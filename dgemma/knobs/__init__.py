"""The sampling knobs clients send (OpenAI's and vLLM's names): each is one module here that declares its option and
its rule on a row's logits (`Knob`, knobs/base.py), registered by name below, in the order the rules run (vLLM's:
the bias, the penalties; then the temperature; then min_p, top_k, top_p). `sampling/processing.py` runs them;
nothing else names one. No torch import: `--help` stays fast."""

from __future__ import annotations

import importlib

from dgemma.knobs.base import Knob

NAMES = ("logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "top_k", "top_p")
KNOBS: tuple[Knob, ...] = tuple(importlib.import_module(f"dgemma.knobs.{name}").KNOB for name in NAMES)

__all__ = ["KNOBS", "Knob"]

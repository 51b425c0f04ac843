"""Checkpoint loading and saving in the Hugging Face layout."""

from dgemma.weights.hf import load_model, resolve_checkpoint, save_model

__all__ = ["load_model", "resolve_checkpoint", "save_model"]

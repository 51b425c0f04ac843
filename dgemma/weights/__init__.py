"""Checkpoint loading and saving: the Hugging Face layout, GGUF files of llama.cpp's diffusion-gemma, and the
kernel-layout cache (kernel_cache.py: int4 weights repacked for the CPU kernel once, memory-mapped after)."""

from dgemma.weights.gguf import is_gguf
from dgemma.weights.gguf_load import load_gguf_model
from dgemma.weights.hf import load_model, resolve_checkpoint, save_model

__all__ = ["is_gguf", "load_gguf_model", "load_model", "resolve_checkpoint", "save_model"]

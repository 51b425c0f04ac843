"""KV storage: the batched cache the encoder writes and the decoder reads; ring buffers for sliding layers."""

from dgemma.cache.kv import KVCache

__all__ = ["KVCache"]

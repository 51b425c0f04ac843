"""KV storage: the cache the encoder writes and the decoder reads (ring buffers for sliding layers), and the
prefix cache that keeps earlier requests' caches for reuse."""

from dgemma.cache.kv import KVCache
from dgemma.cache.prefix import PrefixCache

__all__ = ["KVCache", "PrefixCache"]

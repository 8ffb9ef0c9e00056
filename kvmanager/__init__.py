"""swakv's KV-cache manager: hybrid full / sliding-window / chunked-local attention in one block pool.

Standard library only, so that any engine can embed it.
"""
from .block_pool import NULL_BLOCK_ID
from .manager import CacheStats, KVCacheManager
from .request import Request
from .specs import AttentionSpec, ChunkedLocalAttention, FullAttention, SlidingWindow

__all__ = ["AttentionSpec", "CacheStats", "ChunkedLocalAttention", "FullAttention", "KVCacheManager",
           "NULL_BLOCK_ID", "Request", "SlidingWindow"]

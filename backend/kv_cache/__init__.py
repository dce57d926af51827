"""Paged KV cache: block pool, prefix-cache hashing, copy-on-write, KVCacheManager."""

from loraplex.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue
from loraplex.kv_cache.hashing import hash_block, namespace_key
from loraplex.kv_cache.manager import KVCacheManager
from loraplex.kv_cache.swap_space import SwapSpace

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "KVCacheManager", "SwapSpace", "hash_block", "namespace_key"]

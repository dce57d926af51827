"""Paged KV cache: block pool, prefix-cache hashing, copy-on-write, KVCacheManager."""

from .block_pool import Block, BlockPool, FreeBlockQueue
from .hashing import hash_block, namespace_key
from .manager import KVCacheManager
from .swap_space import SwapSpace

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "KVCacheManager", "SwapSpace", "hash_block", "namespace_key"]

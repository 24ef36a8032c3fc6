"""Physical KV blocks: reference counts, the free LRU queue and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    #: set while the block is registered in the prefix cache
    block_hash: Optional[bytes] = None


class BlockPool:
    """Owns every block. A block is either referenced (ref_count > 0) or in the free
    queue; a free block may still be in the prefix cache ("evictable") until it is
    reallocated. The free queue is LRU: allocation takes from the front, freeing
    appends to the back, so the least recently used cached blocks go first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, evictable cached ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict from the prefix cache
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the queue in order."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: bytes) -> Optional[KVBlock]:
        return self._cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block; a block with the same contents already
        cached keeps its place (this one stays private to its request)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no request holds blocks."""
        if len(self._free) != self.num_blocks:
            return False
        self.invalidate()
        return True

    def invalidate(self) -> None:
        """Forget every cached block, those requests hold too (their contents no longer match
        their hashes: new weights). A held block stays its request's."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

"""Per-request block tables over the BlockPool, with prefix caching.

Prefix caching hashes each full block as ``sha256(parent_hash, extra, tokens)``,
so a block's hash commits to its whole prefix; a hit is a run of leading
blocks whose hashes are cached. ``extra`` carries the adapter identity and the
request's ``cache_salt``, so two adapters, or two tenants, never share KV.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence

from tokenmill.core.engine.request import Request
from tokenmill.core.sched.block_pool import BlockPool, KVBlock

_ROOT_HASH = b"tokenmill-prefix-root"


def hash_block(parent: bytes, token_ids: Sequence[int], extra: str | None) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(b"\x00" if extra is None else b"\x01" + extra.encode() + b"\x00")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        #: the same tables as block ids, a tuple made when a table changes (every scheduled
        #: request's table goes out each step; most steps add no block)
        self._block_ids: dict[str, tuple[int, ...]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        #: prompt tokens looked up in / served by the prefix cache (vLLM's metrics)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return self._block_ids.get(request_id, ())

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of leading cached blocks; never covers the last token,
        whose logits must be computed to sample."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one admitted request's prefix lookup (vLLM's queries/hits, in tokens)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_blocks * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones (and the prefix
        hits in ``computed``, which become the request's leading blocks).
        Returns False, changing nothing, when the pool cannot cover it."""
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size)
        if not computed and needed <= len(blocks):
            return True  # most decode steps: the last block has room
        num_new_blocks = max(0, needed - len(blocks) - len(computed))
        evictable_hits = sum(1 for block in computed if block.ref_count == 0)
        if num_new_blocks + evictable_hits > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed)
        blocks.extend(computed)
        blocks.extend(self.pool.allocate(num_new_blocks))
        self._block_ids[request.request_id] = tuple(block.block_id for block in blocks)
        if computed:
            self._num_cached_blocks[request.request_id] = len(blocks) - num_new_blocks
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_caching or not request.caches_prefix:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        blocks = self._blocks[request.request_id]
        for index in range(start, num_full):
            self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def invalidate(self, unfinished: Iterable[Request]) -> None:
        """The weights changed: forget every cached block, and let no request that computed KV
        under the old ones (on the device or swapped out) register blocks later, since their
        contents follow from that KV."""
        self.pool.invalidate()
        for request in unfinished:
            if request.num_computed_tokens > 0:
                request.caches_prefix = False

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` slots (rejected draft tokens'),
        tail first. Those blocks hold no computed token, so none of them is cached."""
        blocks = self._blocks.get(request.request_id, [])
        keep = -(-num_tokens // self.block_size)
        if len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self._block_ids[request.request_id] = self._block_ids[request.request_id][:keep]
            self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its prefix stays cached longest."""
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(
                hash_block(parent, tokens[index * size:(index + 1) * size], request.cache_key)
            )

"""Block accounting and prefix-cache invariants of the paged KV cache, by property tests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.core.sched.block_pool import BlockPool
from tokenmill.core.sched.kv_cache_manager import KVCacheManager, hash_block
from tokenmill.core.engine.request import Request
from tokenmill.interfaces.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int], adapter: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(), arrival_time=0.0, arrival_index=0,
                   eos_token_ids=(), max_model_len=10_000, adapter_name=adapter)


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, progress and frees over a small pool, like a scheduler would do."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=10))
    def admit(self, prefix, tail):
        request = make_request(f"r{self.counter}", prefix + tail)
        self.counter += 1
        hits = self.kv.get_computed_blocks(request)
        # a hit never covers the last token: its logits must be computed
        assert len(hits) * BLOCK < request.num_tokens
        num_new = request.num_tokens - len(hits) * BLOCK
        if self.kv.allocate_slots(request, num_new, hits):
            request.num_computed_tokens = request.num_tokens
            self.kv.cache_blocks(request)
            self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.append_token(data.draw(st.integers(0, 3)))
        if self.kv.allocate_slots(request, 1):
            request.num_computed_tokens += 1
            self.kv.cache_blocks(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)

    @invariant()
    def every_block_free_xor_referenced(self):
        pool = self.kv.pool
        references: dict[int, int] = {}
        for request in self.live.values():
            for block_id in self.kv.block_ids(request.request_id):
                references[block_id] = references.get(block_id, 0) + 1
        for block in pool.blocks:
            assert pool.is_free(block) == (block.ref_count == 0)
            assert block.ref_count == references.get(block.block_id, 0)

    @invariant()
    def block_tables_cover_computed_tokens(self):
        for request in self.live.values():
            assert self.kv.num_blocks_of(request.request_id) == -(-request.num_computed_tokens // BLOCK)

    @invariant()
    def cached_blocks_hold_their_hash(self):
        for block_hash, block in self.kv.pool._cached.items():
            assert block.block_hash == block_hash

    def teardown(self):
        for request in self.live.values():
            self.kv.free(request)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 1000), min_size=8, max_size=8), st.integers(0, 1000))
def test_hash_chain_commits_to_the_whole_prefix(tokens, other):
    """Equal block contents under different parents or adapters hash differently."""
    first = hash_block(b"root", tokens[:4], None)
    second = hash_block(first, tokens[4:], None)
    assert hash_block(first, tokens[4:], None) == second
    changed = [other if i == 0 and other != tokens[0] else t for i, t in enumerate(tokens)]
    if changed != tokens:
        assert hash_block(hash_block(b"root", changed[:4], None), tokens[4:], None) != second
    assert hash_block(first, tokens[4:], "adapter-a") != second


def test_prefix_hit_reuses_blocks_and_lru_evicts_oldest():
    """A freed prefix stays cached until the pool needs its blocks, least recent first."""
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_blocks(first)
    first_blocks = kv.block_ids("a")
    kv.free(first)
    assert kv.pool.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2

    again = make_request("b", list(range(9)))
    hits = kv.get_computed_blocks(again)
    assert tuple(b.block_id for b in hits) == first_blocks[:2]
    assert kv.allocate_slots(again, 1, hits)
    assert kv.block_ids("b")[:2] == tuple(b.block_id for b in hits)

    # a cold request needing every free block evicts the cached ones
    kv.free(again)
    cold = make_request("c", [100 + i for i in range(16)])
    assert kv.get_computed_blocks(cold) == []
    assert kv.allocate_slots(cold, 16)
    assert kv.pool.num_cached_blocks == 0


def test_adapters_never_share_prefix_blocks():
    """The same tokens under another adapter miss the cache."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True)
    base = make_request("a", list(range(9)), adapter="sql")
    assert kv.allocate_slots(base, 9)
    base.num_computed_tokens = 9
    kv.cache_blocks(base)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), adapter="chat")) == []
    assert len(kv.get_computed_blocks(make_request("c", list(range(9)), adapter="sql"))) == 2


def test_allocation_failure_changes_nothing():
    """allocate_slots either succeeds whole or leaves the pool untouched."""
    pool_blocks = 3
    kv = KVCacheManager(num_blocks=pool_blocks, block_size=BLOCK, enable_caching=False)
    request = make_request("a", list(range(20)))
    assert not kv.allocate_slots(request, 20)
    assert kv.pool.num_free_blocks == pool_blocks
    assert kv.block_ids("a") == ()


def test_double_free_is_caught():
    """Freeing a block twice is an invariant violation, not silent corruption."""
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.free([block])
    try:
        pool.free([block])
    except AssertionError:
        return
    raise AssertionError("double free went unnoticed")

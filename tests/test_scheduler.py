"""The continuous-batching mechanism: budgets, chunked prefill, preemption, policies."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.config.engine_config import SchedulerConfig
from tokenmill.core.sched.kv_cache_manager import KVCacheManager
from tokenmill.core.engine.request import Request, RequestStatus
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.interfaces.batch import ModelRunnerOutput
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.plugins.schedulers.fifo import FifoPolicy


def make_scheduler(num_blocks=64, block_size=4, caching=True, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(**config), kv, FifoPolicy())


def add(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4,
        first_token: int = 0) -> Request:
    request = Request(request_id, [first_token + i for i in range(prompt_len)],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=float(len(scheduler.requests)), arrival_index=len(scheduler.requests),
                      eos_token_ids=(), max_model_len=10_000)
    scheduler.add_request(request)
    return request


def run_step(scheduler: Scheduler, token: int = 7):
    batch = scheduler.schedule()
    result = ModelRunnerOutput({s.request_id: [token] for s in batch.scheduled if s.sample}, {}, {})
    scheduler.update(batch, result)
    return batch


def test_token_budget_and_chunked_prefill():
    """A 10-token prompt under a 4-token budget is computed in chunks of 4, 4, 2, then decodes."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", 10, max_tokens=2)
    chunks = []
    while scheduler.has_unfinished_requests():
        batch = run_step(scheduler)
        chunks.append([(s.num_computed_tokens, len(s.new_token_ids), s.sample) for s in batch.scheduled])
    assert chunks == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)], [(10, 1, True)]]


def test_without_chunking_a_long_prompt_waits_for_budget():
    """With chunked prefill off, a prompt larger than the remaining budget is not split."""
    scheduler = make_scheduler(max_num_batched_tokens=12, chunked_prefill=False)
    add(scheduler, "a", 8)
    add(scheduler, "b", 8)
    batch = scheduler.schedule()
    assert [(s.request_id, len(s.new_token_ids)) for s in batch.scheduled] == [("a", 8)]


def test_decodes_and_prefills_mix_in_one_step():
    """A running request's decode token and a new prompt share one batch."""
    scheduler = make_scheduler(max_num_batched_tokens=32)
    add(scheduler, "a", 5)
    run_step(scheduler)
    add(scheduler, "b", 6, first_token=100)
    batch = run_step(scheduler)
    assert [(s.request_id, len(s.new_token_ids)) for s in batch.scheduled] == [("a", 1), ("b", 6)]


def test_max_num_seqs_caps_running_requests():
    """No more than max_num_seqs requests run at once; the rest wait their turn."""
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(scheduler, f"r{i}", 3)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == 3


def test_preemption_frees_blocks_and_recomputes_latest_request():
    """When blocks run out FIFO preempts the newest running request, which later recomputes."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, caching=False, max_num_batched_tokens=64)
    a = add(scheduler, "a", 7, max_tokens=6)
    b = add(scheduler, "b", 7, max_tokens=6, first_token=100)
    run_step(scheduler)  # both prefilled: 2 blocks each, pool full
    run_step(scheduler)  # the 8th tokens still fit
    batch = run_step(scheduler)  # a's 9th token needs a 3rd block -> b is preempted
    assert batch.preempted_request_ids == ("b",)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert b.metrics.num_preemptions == 1
    assert scheduler.kv_cache.pool.num_free_blocks == 4


def test_prefix_hit_skips_computed_blocks_but_not_the_last_token():
    """A second identical prompt starts after the cached full blocks, never at its end."""
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", 8, max_tokens=1)
    run_step(scheduler)
    add(scheduler, "b", 8, max_tokens=1)
    batch = scheduler.schedule()
    [item] = batch.scheduled
    assert item.num_computed_tokens == 4 and len(item.new_token_ids) == 4


def test_finished_requests_are_reported_to_the_runner_once():
    """The runner learns of each finished request exactly once, so it can drop its state."""
    scheduler = make_scheduler()
    add(scheduler, "a", 3, max_tokens=1)
    first = run_step(scheduler)
    assert [n.request_id for n in first.new_requests] == ["a"]
    assert scheduler.schedule().finished_request_ids == {"a"}
    assert scheduler.schedule().finished_request_ids == frozenset()


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8)), min_size=1, max_size=12),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 6),
    num_blocks=st.integers(10, 40),
    chunked=st.booleans(),
)
def test_random_traces_finish_every_request_within_limits(prompts, budget, max_seqs, num_blocks, chunked):
    """Any trace: budgets hold every step, no request is lost, and all blocks come back."""
    if not chunked:
        budget = max(budget, 30)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                               max_num_seqs=max_seqs, chunked_prefill=chunked)
    requests = [add(scheduler, f"r{i}", n, max_tokens=m, first_token=i % 3)
                for i, (n, m) in enumerate(prompts)]
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        batch = run_step(scheduler)
        assert batch.num_scheduled_tokens <= budget
        assert len(batch.scheduled) <= max_seqs
        assert len(scheduler.running) <= max_seqs
    assert not scheduler.has_unfinished_requests()
    for request, (_, max_tokens) in zip(requests, prompts):
        assert request.num_output_tokens == max_tokens
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks

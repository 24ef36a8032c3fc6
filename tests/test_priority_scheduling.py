"""Priority scheduling that really preempts, aging, and swap preemption."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NEW_TOKENS, PROMPTS, make_llm
from tokenmill import SamplingParams
from tokenmill.core.config.engine_config import SchedulerConfig
from tokenmill.core.sched.kv_cache_manager import KVCacheManager
from tokenmill.core.engine.request import Request, RequestStatus
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.sched.swap_space import SwapSpace
from tokenmill.interfaces.batch import ModelRunnerOutput
from tokenmill.interfaces.errors import ConfigError
from tokenmill.plugins.schedulers.priority import PriorityPolicy
from tokenmill.testing.hf_reference import assert_matches_reference


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=64, block_size=4, clock=None, swap_blocks=None, policy_config=None, **config):
    config = SchedulerConfig(policy="priority", policy_config=policy_config or {},
                             preemption_mode="swap" if swap_blocks else "recompute", **config)
    policy = PriorityPolicy(config, clock=clock or FakeClock())
    swap = SwapSpace(swap_blocks) if swap_blocks else None
    return Scheduler(config, KVCacheManager(num_blocks, block_size, False), policy, swap)


def add(scheduler, request_id, priority, prompt_len=4, max_tokens=4, arrival=None):
    index = len(scheduler.requests) + scheduler.num_preemptions_total + 1000 * len(request_id)
    request = Request(request_id, [7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=float(index) if arrival is None else arrival, arrival_index=index,
                      eos_token_ids=(), max_model_len=10_000, priority=priority)
    scheduler.add_request(request)
    return request


def step(scheduler):
    batch = scheduler.schedule()
    scheduler.update(batch, ModelRunnerOutput({s.request_id: [9] for s in batch.scheduled if s.sample}, {}, {}))
    return batch


def test_high_priority_arrival_preempts_a_full_batch_within_one_step():
    """With every seat taken by priority-5 requests, a priority-0 arrival runs in the next step."""
    scheduler = make_scheduler(max_num_seqs=3)
    low = [add(scheduler, f"low{i}", 5, max_tokens=50, arrival=float(i)) for i in range(3)]
    step(scheduler)
    assert all(r.status is RequestStatus.RUNNING for r in low)
    urgent = add(scheduler, "urgent", 0, arrival=10.0)
    batch = step(scheduler)
    assert urgent.status is RequestStatus.RUNNING
    assert "urgent" in [s.request_id for s in batch.scheduled]
    assert batch.preempted_request_ids == ("low2",)  # the latest of the worst priority


def test_high_priority_preempts_when_kv_blocks_are_full():
    """A batch full by KV blocks (not seats) also yields to a better priority."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=8)
    low = [add(scheduler, f"low{i}", 3, prompt_len=8, max_tokens=3, arrival=float(i)) for i in range(3)]
    step(scheduler)
    assert scheduler.kv_cache.pool.num_free_blocks == 0
    urgent = add(scheduler, "urgent", 0, prompt_len=8, arrival=5.0)
    step(scheduler)
    assert urgent.status is RequestStatus.RUNNING
    assert sum(r.status is RequestStatus.PREEMPTED for r in low) >= 1


def test_preempted_requests_resume_in_priority_then_arrival_order():
    """Victims keep their priority and arrival; they come back best-first, oldest-first."""
    scheduler = make_scheduler(max_num_seqs=3)
    add(scheduler, "a", 2, max_tokens=30, arrival=1.0)
    add(scheduler, "b", 1, max_tokens=30, arrival=2.0)
    add(scheduler, "c", 2, max_tokens=30, arrival=3.0)
    step(scheduler)
    for i in range(3):
        add(scheduler, f"u{i}", 0, max_tokens=2, arrival=10.0 + i)
    step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"u0", "u1", "u2"}
    assert [r.request_id for r in scheduler.waiting] == ["b", "a", "c"]


def test_equal_priorities_never_preempt_each_other():
    """Same priority: newcomers wait; no churn."""
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(2):
        add(scheduler, f"r{i}", 1, max_tokens=20, arrival=float(i))
    step(scheduler)
    add(scheduler, "late", 1, arrival=5.0)
    assert step(scheduler).preempted_request_ids == ()


def test_aging_lets_low_priority_requests_overtake():
    """With aging, a long-waiting priority-9 request eventually ranks above fresh priority-1 ones."""
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1, clock=clock, policy_config={"aging_seconds": 1.0})
    old = add(scheduler, "old", 9, arrival=0.0)
    fresh = add(scheduler, "fresh", 1, arrival=0.0)
    policy = scheduler.policy
    assert policy.sort_key(fresh) < policy.sort_key(old)
    clock.now = 20.0
    newer = add(scheduler, "newer", 1, arrival=20.0)
    assert policy.sort_key(old) < policy.sort_key(newer)


def test_bad_policy_options_name_their_key():
    """Unknown or invalid policy options fail at startup with the key path."""
    with pytest.raises(ConfigError, match="scheduler.policy_config.aging_seconds"):
        PriorityPolicy(SchedulerConfig(policy_config={"aging_seconds": -1}))
    with pytest.raises(ConfigError, match="scheduler.policy_config.bogus"):
        PriorityPolicy(SchedulerConfig(policy_config={"bogus": 1}))


@settings(max_examples=40, deadline=None)
@given(trace=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12), st.integers(1, 6), st.integers(0, 3)),
                      min_size=1, max_size=16),
       max_seqs=st.integers(1, 4), num_blocks=st.integers(8, 24), swap=st.booleans())
def test_random_traces_lose_nothing_and_do_not_starve_with_aging(trace, max_seqs, num_blocks, swap):
    """Random priorities and arrivals with aging: all requests finish, blocks and swap space return."""
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, clock=clock, max_num_seqs=max_seqs,
                               max_num_batched_tokens=32, swap_blocks=12 if swap else None,
                               policy_config={"aging_seconds": 2.0})
    pending = sorted(enumerate(trace), key=lambda item: item[1][3])
    requests = []
    for tick in range(3000):
        clock.now = float(tick)
        while pending and pending[0][1][3] <= tick:
            i, (priority, prompt_len, max_tokens, _) = pending.pop(0)
            requests.append(add(scheduler, f"r{i}", priority, prompt_len, max_tokens, arrival=float(tick)))
        if not pending and not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        assert scheduler.num_swapped == sum(r.status is RequestStatus.SWAPPED for r in scheduler.waiting)
    assert not pending and not scheduler.has_unfinished_requests()
    assert all(r.num_output_tokens == trace[int(r.request_id[1:])][2] for r in requests)
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks
    if swap:
        assert scheduler.swap_space.num_free_blocks == 12


def test_swap_resumes_without_recomputing_and_falls_back_when_full():
    """A swapped victim resumes at its computed position; a full swap space means recompute."""
    scheduler = make_scheduler(max_num_seqs=2, swap_blocks=3)
    a = add(scheduler, "a", 5, prompt_len=8, max_tokens=20, arrival=0.0)
    b = add(scheduler, "b", 5, prompt_len=8, max_tokens=20, arrival=1.0)
    step(scheduler)
    step(scheduler)
    add(scheduler, "u1", 0, max_tokens=2, arrival=5.0)
    add(scheduler, "u2", 0, max_tokens=2, arrival=6.0)
    batch = step(scheduler)
    # b (3 blocks) fits the swap space; a (3 blocks) then finds it full and is recomputed
    assert set(batch.preempted_request_ids) == {"a", "b"}
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 9
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert len(batch.blocks_to_swap_out) == 3
    # per-step stats for observers and metrics
    assert (batch.stats.num_preempted, batch.stats.num_swapped, batch.stats.num_running) == (2, 1, 2)
    assert batch.stats.num_scheduled_tokens == batch.num_scheduled_tokens
    while b.status is not RequestStatus.RUNNING:
        batch = step(scheduler)
    resumed = next(s for s in batch.scheduled if s.request_id == "b")
    assert resumed.num_computed_tokens == 9 and len(resumed.new_token_ids) == 1
    assert len(batch.blocks_to_swap_in) == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_heavy_preemption_with_priorities_matches_hf(mode, model_dir, hf_reference):
    """Mixed priorities over a tiny KV pool, in both preemption modes, still decode exactly as HF."""
    llm = make_llm(model_dir("llama"), num_gpu_blocks_override=24, block_size=8, max_model_len=192,
                   scheduling_policy="priority", preemption_mode=mode, swap_space="4MiB")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           priority=[i % 3 for i in range(len(PROMPTS))])
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert scheduler.num_swaps_total > 0
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)


def test_swap_mode_computes_fewer_tokens_than_recompute(model_dir):
    """Under the same pressure, swap recomputes nothing: it schedules fewer tokens in total."""
    def total_scheduled(mode):
        llm = make_llm(model_dir("llama"), num_gpu_blocks_override=24, block_size=8, max_model_len=192,
                       preemption_mode=mode, swap_space="4MiB", enable_prefix_caching=False)
        engine, total = llm.llm_engine, 0
        schedule = engine.scheduler.schedule

        def counting():
            nonlocal total
            batch = schedule()
            total += batch.num_scheduled_tokens
            return batch

        engine.scheduler.schedule = counting
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=NEW_TOKENS,
                     ignore_eos=True), use_tqdm=False)
        return total, engine.scheduler.num_swaps_total

    recompute_tokens, _ = total_scheduled("recompute")
    swap_tokens, swaps = total_scheduled("swap")
    minimum = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    assert swaps > 0
    assert swap_tokens == minimum < recompute_tokens


def test_fifo_ignores_priorities_with_one_warning(model_dir, capsys):
    """Under FIFO a priority is ignored and the log says so once."""
    llm = make_llm(model_dir("llama"))
    llm.generate(["a b", "c d"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[3, 4])
    llm.generate(["e f"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    assert capsys.readouterr().out.count("priorities are ignored") == 1


def test_the_swap_space_is_one_host_allocation(model_dir):
    """Every layer's host twin is a view of one buffer: torch's pinned allocator rounds each
    allocation up to a power of two, so one per layer pinned up to twice the swap space."""
    llm = make_llm(model_dir("llama"), num_gpu_blocks_override=24, block_size=8, max_model_len=192,
                   preemption_mode="swap", swap_space="4MiB")
    host = llm.llm_engine.runner.model_step.swap.host
    storage = host[0].untyped_storage()
    assert len(host) > 1 and all(h.untyped_storage().data_ptr() == storage.data_ptr() for h in host)
    assert sum(h.numel() for h in host) * host[0].element_size() == storage.nbytes()

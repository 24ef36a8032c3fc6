"""The KV budget leaves room for a step's activations, measured by a profiling forward pass
on platforms that share device memory between them (the cuda platform; here a platform
defined in the test that reports a fixed peak, the pass itself being real)."""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS, PROMPTS, greedy_in_batches, with_platforms
from tokenmill import LLM, load_config
from tokenmill.core.worker.memory_profile import profile_step
from tokenmill.interfaces.platform import Platform
from tokenmill.testing.hf_reference import assert_matches_reference

ACTIVATIONS = 3 * 2**20


class ProfilingPlatform(Platform):
    """Plain PyTorch on the CPU whose 'device' reports a 3 MiB activation peak."""

    name = "cpu-profiling"
    priority = -1
    profiles_memory = True

    def __init__(self, config, options=None) -> None:
        super().__init__(config, options)
        self.profiled_steps = 0

    def peak_memory(self, run) -> int:
        run()
        self.profiled_steps += 1
        return ACTIVATIONS

    def kv_cache_memory(self, requested: int, activation_bytes: int = 0) -> int:
        return requested - activation_bytes


@pytest.mark.parametrize("tokens,max_seqs,max_len,block,lengths", [
    (4096, 256, 2048, 16, [16] * 256),
    (100, 3, 40, 8, [34, 33, 33]),
    (100, 1, 40, 8, [34, 33, 33]),  # one request cannot hold them all: as many as it takes
    (5, 8, 512, 16, [1] * 5),
])
def test_the_profiled_step_is_the_largest_the_scheduler_can_form(tokens, max_seqs, max_len, block, lengths):
    step = profile_step(tokens, max_seqs, max_len, block)
    assert [len(row.token_ids) for row in step.rows] == lengths
    assert all(len(row.block_ids) * block >= row.num_computed_tokens + len(row.token_ids) for row in step.rows)
    # the last request ends the longest context: the widest block table a step can have
    assert step.rows[-1].num_computed_tokens + len(step.rows[-1].token_ids) == max_len
    assert len(step.rows[-1].block_ids) == -(-max_len // block)
    assert step.logits_rows == [sum(lengths[:i + 1]) - 1 for i in range(len(lengths))]


def test_the_kv_budget_leaves_the_measured_activations_and_the_engine_stays_exact(model_dir, hf_reference):
    budget = 8 * 2**20
    llm = LLM(config=load_config(model=str(model_dir("llama")), device="cpu-profiling", kv_cache_memory_bytes=budget,
                                 max_num_batched_tokens=64, block_size=8), plugin_manager=with_platforms(ProfilingPlatform))
    engine = llm.llm_engine
    assert engine.platform.profiled_steps == 1
    caches = [m.kv_cache for m in engine.runner.model.modules() if hasattr(m, "kv_cache")]
    per_block = sum(cache[:, :1].numel() * cache.element_size() for cache in caches)
    assert engine.scheduler.kv_cache.pool.num_blocks == (budget - ACTIVATIONS) // per_block
    assert all(cache.shape[1] == engine.scheduler.kv_cache.pool.num_blocks for cache in caches)  # the real caches
    tokens, logprobs = greedy_in_batches(llm, PROMPTS, batch=4)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)

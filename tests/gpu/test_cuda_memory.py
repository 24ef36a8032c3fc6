"""On a CUDA GPU: the KV budget leaves room for the profiled activation peak, and the largest
step the scheduler can form then runs."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs


from cuda_engines import cuda_llm
from tokenmill import SamplingParams


@pytest.mark.gpu_alone
def test_the_kv_budget_leaves_room_for_the_largest_step(model_dir):
    with capture_logs() as logs:
        llm = cuda_llm(model_dir("llama"), dtype="bfloat16", max_num_batched_tokens=2048,
                       max_num_seqs=16)
    profiled = [entry for entry in logs if entry["event"] == "memory profiled"]
    assert len(profiled) == 1 and profiled[0]["activation_mib"] > 0
    platform = llm.llm_engine.platform
    free, total = torch.cuda.mem_get_info()
    own = total - free - platform._used_before
    utilization = platform.options.gpu_memory_utilization
    assert total * utilization - 2**30 <= own <= total * utilization + 2**28  # the caches filled the budget
    prompts = [[(7 * i + j) % 200 + 3 for j in range(128)] for i in range(16)]  # 2048 prompt tokens at once
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4] * 16


def _kv_bytes(model) -> int:
    caches = [m.kv_cache for m in model.modules() if getattr(m, "kv_cache", None) is not None]
    return sum(t.nbytes for cache in caches for t in (cache if isinstance(cache, (tuple, list)) else [cache]))


def test_sleep_frees_the_gpu_memory_and_waking_gives_the_same_tokens(model_dir):
    """Sleep mode (a trainer takes the GPU between rollouts): level 1 moves the weights to the
    host (pinned memory: the copies run at the link's speed) and frees the KV cache, level 2 frees
    the weights too (reloaded from the checkpoint);
    this process's allocations drop by both, the allocator hands the memory back, and the engine
    wakes to the same tokens, its graphs recorded again over the new addresses."""
    llm = cuda_llm(model_dir("llama"), dtype="bfloat16", enable_sleep_mode=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [(5 * j) % 200 + 3 for j in range(40)]}
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    model = llm.llm_engine.runner.model
    freed = sum(p.numel() * p.element_size() for p in model.parameters()) + _kv_bytes(model)
    torch.cuda.synchronize()
    awake, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for level in (1, 2):
        llm.sleep(level=level)
        offloaded = llm.llm_engine.control.plane.local._offloaded
        assert level == 2 or (offloaded and all(t.is_pinned() for t in offloaded.values()))
        assert torch.cuda.memory_allocated() <= awake - 0.9 * freed
        assert torch.cuda.memory_reserved() <= reserved - 0.9 * freed  # back to the driver (empty_cache)
        llm.wake_up()
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == before

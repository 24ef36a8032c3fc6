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

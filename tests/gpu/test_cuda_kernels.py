"""On a CUDA GPU: the Triton attention kernels (compiled, not interpreted) equal the torch
reference at serving shapes, and the engine's speculative and plain decoding agree there."""

from __future__ import annotations

import pytest
import torch

from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention
from tokenmill.testing.attention_conformance import AttentionCase, check_backend

#: Llama-3-8B-like (32q / 8kv x 128), Qwen2-7B-like (28 / 4 x 128), Gemma-2-like windows and
#: soft caps; prefill chunks of 512 on cached prefixes, decodes over 4k contexts
SERVING = [
    AttentionCase(0, 32, 8, 128, 16, torch.bfloat16, ((0, 512), (1024, 512), (4000, 1), (2048, 1), (0, 1))),
    AttentionCase(1, 28, 4, 128, 16, torch.float16, ((3000, 1),) * 8 + ((0, 300),)),
    AttentionCase(2, 16, 8, 256, 32, torch.bfloat16, ((4096, 1), (100, 700)), sliding_window=4096, soft_cap=50.0),
]


@pytest.mark.parametrize("case", SERVING, ids=str)
def test_triton_attention_matches_the_reference_at_serving_shapes(case):
    check_backend(TritonPagedAttention(), case, device="cuda")

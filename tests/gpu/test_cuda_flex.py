"""On a CUDA GPU: the flex backend compiled (FlexAttention's Triton kernels) equals the torch
reference at serving shapes, and the engine with it decodes Hugging Face's greedy tokens.

Not in the default GPU suite: each layer configuration compiles first (tens of seconds);
``bash benchmarks/gpu_check.sh flex`` runs it, beside the flex timings. Tolerance as in
test_cuda_parity.py (both sides compute in bf16 with different kernels)."""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS, PROMPTS
from cuda_engines import cuda_llm
from test_cuda_kernels import SERVING
from tokenmill import SamplingParams
from tokenmill.plugins.attention.flex.backend import FlexAttentionBackend
from tokenmill.testing.attention_conformance import check_backend, supports
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy


@pytest.mark.parametrize("case", [c for c in SERVING if supports(FlexAttentionBackend(), c)], ids=str)
def test_flex_attention_matches_the_reference_at_serving_shapes(case):
    check_backend(FlexAttentionBackend(), case, device="cuda")


def test_flex_attention_reaches_a_cache_past_int32_offsets():
    """FlexAttention's generated indexing over a per-layer cache past 2**31 elements a K/V half."""
    check_backend(FlexAttentionBackend(), SERVING[0], device="cuda", past_int32=True)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # plain GQA; sliding windows and soft caps
def test_engine_on_flex_matches_hf(arch, model_dir):
    llm = cuda_llm(model_dir(arch), dtype="bfloat16", attention_backend="flex")
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    reference = hf_greedy(model_dir(arch), PROMPTS, NEW_TOKENS, dtype=torch.bfloat16, device="cuda")
    assert_matches_reference(reference, tokens, logprobs, tie_tolerance=0.1, logprob_tolerance=0.1)

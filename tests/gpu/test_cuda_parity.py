"""On a CUDA GPU: the cuda platform (weights, KV cache and Triton attention on the device)
decodes Hugging Face's greedy tokens for every family, in bf16 and fp16.

Tolerance: both sides compute in bf16/fp16 with different kernels (Triton attention and
cuBLAS GEMMs here, eager SDPA there), so logits differ by a few units in the last place of
bf16 (2^-8 relative); the reference's top-2 margin decides where a divergence is allowed
(0.1 in bf16, 0.02 in fp16), and chosen-token logprobs must agree to 0.1 (bf16) / 0.02 (fp16)."""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS, PROMPTS
from cuda_engines import cuda_llm
from tokenmill import SamplingParams
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy

FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2"]
TOLERANCE = {"bfloat16": 0.1, "float16": 0.02}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_matches_hf(arch, dtype, model_dir):
    llm = cuda_llm(model_dir(arch), dtype=dtype)
    assert llm.llm_engine.platform.name == "cuda"
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    reference = hf_greedy(model_dir(arch), PROMPTS, NEW_TOKENS, dtype=getattr(torch, dtype), device="cuda")
    assert_matches_reference(reference, tokens, logprobs, tie_tolerance=TOLERANCE[dtype],
                             logprob_tolerance=TOLERANCE[dtype])

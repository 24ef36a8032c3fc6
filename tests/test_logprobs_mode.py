"""``logprobs_mode`` (vLLM's engine option): sampled tokens' logprobs are the raw
distribution's logprobs or logits, or those of the distribution the token was drawn from
(after temperature). Checked against transformers' logits of the same tokens, fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_llm
from tokenmill import SamplingParams

TEMPERATURE = 0.7


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_each_mode_reports_its_values_of_the_sampled_tokens(mode, model_dir):
    path = model_dir("llama")
    llm = make_llm(path, logprobs_mode=mode, dtype="float32")
    prompt = list(range(7, 19))
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=3, logprobs=2, ignore_eos=True)
    [completion] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + list(completion.token_ids)])).logits[0, len(prompt) - 1:-1]
    if mode.startswith("processed"):
        logits = logits / TEMPERATURE
    expected = logits.log_softmax(-1) if mode.endswith("logprobs") else logits
    for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(entry[token].logprob - expected[position, token].item()) < 1e-4, (position, mode)
        top = expected[position].topk(2).indices.tolist()
        assert all(abs(entry[t].logprob - expected[position, t].item()) < 1e-4 for t in top)

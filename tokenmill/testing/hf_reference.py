"""Greedy reference runs with Hugging Face transformers, and parity checks against them.

The comparison rule is the project's correctness standard: the same greedy
tokens, except that a divergence is allowed where the reference's top-2
logits tie within ``tie_tolerance`` (then the rest of that sequence is not
compared); chosen-token logprobs within ``logprob_tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM


@dataclass(frozen=True)
class ReferenceSequence:
    token_ids: list[int]
    #: log-softmax of the chosen token at each step
    logprobs: list[float]
    #: top-1 minus top-2 logit at each step
    margins: list[float]


def hf_greedy(model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[ReferenceSequence]:
    """Greedy decoding of each prompt alone (no padding), EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            past = None
            tokens, logprobs, margins = [], [], []
            for _ in range(max_new_tokens):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                top2 = logits.topk(2)
                token = int(top2.indices[0])
                tokens.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                margins.append(float(top2.values[0] - top2.values[1]))
                ids = torch.tensor([[token]])
            results.append(ReferenceSequence(tokens, logprobs, margins))
    return results


def assert_matches_reference(
    reference: Sequence[ReferenceSequence],
    token_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]] | None = None,
    *,
    tie_tolerance: float = 1e-5,
    logprob_tolerance: float = 1e-4,
) -> None:
    """Raise AssertionError describing the first real mismatch."""
    assert len(reference) == len(token_ids), "different number of sequences"
    for i, ref in enumerate(reference):
        got = list(token_ids[i])
        assert len(got) >= len(ref.token_ids), (
            f"sequence {i}: {len(got)} tokens, reference has {len(ref.token_ids)}")
        for step, expected in enumerate(ref.token_ids):
            if got[step] != expected:
                assert ref.margins[step] <= tie_tolerance, (
                    f"sequence {i} diverges at step {step}: got {got[step]}, expected {expected} "
                    f"(reference top-2 margin {ref.margins[step]:.3g} is no tie)\n"
                    f"got      {got}\nexpected {ref.token_ids}")
                break
            if logprobs is not None:
                diff = abs(logprobs[i][step] - ref.logprobs[step])
                assert diff < logprob_tolerance, (
                    f"sequence {i} step {step}: logprob {logprobs[i][step]:.6f} vs "
                    f"reference {ref.logprobs[step]:.6f} (diff {diff:.2e})")

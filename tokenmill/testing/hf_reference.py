"""Greedy reference runs with Hugging Face transformers, and parity checks against them.

The comparison rule is the project's correctness standard: the same greedy
tokens, except that a divergence is allowed where the reference's top-2
logits tie within ``tie_tolerance`` (then the rest of that sequence is not
compared); chosen-token logprobs within ``logprob_tolerance``.

A mixture-of-experts model ties in a second place: where a router's k-th and (k+1)-th
logits tie, which expert serves the token is arbitrary, and the two choices give
different logits from then on (in bf16 exact router ties are common: the tiny Mixtral
meets one in 288 steps, on the CPU and on an H100 alike). Such a step ends the
comparison of its sequence as a logit tie does.
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
    #: mixture-of-experts models: at each step, the smallest gap between a router's k-th and
    #: (k+1)-th logits over the layers and the positions the step's forward pass read
    router_margins: list[float] | None = None


def hf_greedy(model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[ReferenceSequence]:
    """Greedy decoding of each prompt alone (no padding), EOS ignored, ``max_new_tokens`` tokens
    (one count for all, or one per prompt, as requests of different lengths ask). On a GPU the
    reference runs there too (``device="cuda"``): bf16 and fp16 on a CPU are emulated,
    minutes for a tiny MoE model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    top_k = getattr(model.config, "num_experts_per_tok", None)
    results = []
    with torch.inference_mode():
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
        for prompt, count in zip(prompts, counts):
            ids = torch.tensor([list(prompt)], device=device)
            past = None
            tokens, logprobs, margins, router_margins = [], [], [], []
            for _ in range(count):
                out = model(input_ids=ids, past_key_values=past, use_cache=True,
                            **({"output_router_logits": True} if top_k else {}))
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                top2 = logits.topk(2)
                token = int(top2.indices[0])
                tokens.append(token)
                logprobs.append(float(logits.log_softmax(-1)[token]))
                margins.append(float(top2.values[0] - top2.values[1]))
                if top_k:
                    router_margins.append(_router_margin(out.router_logits, top_k))
                ids = torch.tensor([[token]], device=device)
            results.append(ReferenceSequence(tokens, logprobs, margins, router_margins if top_k else None))
    return results


def _router_margin(router_logits: Sequence[torch.Tensor], top_k: int) -> float:
    """The smallest k-th minus (k+1)-th router logit over layers and positions."""
    top = torch.cat([layer.float() for layer in router_logits]).topk(top_k + 1, dim=-1).values
    return float((top[:, top_k - 1] - top[:, top_k]).min())


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
            if ref.router_margins is not None and ref.router_margins[step] <= tie_tolerance:
                break  # a routing tie: either expert choice is the model's output
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

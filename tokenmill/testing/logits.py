"""Raw logits of every prompt position, computed through an engine's own model and KV cache.

For comparisons against reference logits (quantized checkpoints): the prompt
runs as one request in a single forward pass, exactly as a prefill would (on
every rank of a multi-process model, whose logits are gathered).
"""

from __future__ import annotations

import torch

from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.prompt_forward import head_outputs


def prompt_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32 logits; the engine must be idle."""
    [logits] = head_outputs(engine, [token_ids], lambda n: range(n))
    return logits

"""Raw logits of every prompt position, computed through an engine's own model and KV cache.

For comparisons against reference logits (quantized checkpoints): the prompt
runs as one request in a single forward pass, exactly as a prefill would (on
every rank of a multi-process model, whose logits are gathered).
"""

from __future__ import annotations

import torch

from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.request import Request
from tokenmill.interfaces.types import SamplingParams


@torch.inference_mode()
def prompt_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32 logits; the engine must be idle."""
    kv = engine.scheduler.kv_cache
    request = Request("__logits__", list(token_ids), SamplingParams(), arrival_time=0.0, arrival_index=-1,
                      eos_token_ids=(), max_model_len=engine.max_model_len)
    if not kv.allocate_slots(request, len(token_ids)):
        raise RuntimeError("the KV cache cannot hold this prompt")
    try:
        step = Step([Row(list(token_ids), 0, list(kv.block_ids("__logits__")))], list(range(len(token_ids))), False)
        return engine.runner.model_step.run(step).logits
    finally:
        kv.free(request)

"""Prompts through an engine's own model and KV cache outside the scheduler: the head's
output at chosen positions of each prompt, one forward pass for a batch of prompts (as a
prefill would run them, on every rank). What classification heads are read through
(the last position), and tests' raw logits (every position). Run it between steps."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.engine.request import Request
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.sampling_params import SamplingParams


@torch.inference_mode()
def head_outputs(engine, prompts: Sequence[Sequence[int]],
                 positions: Callable[[int], Sequence[int]]) -> list[torch.Tensor]:
    """For each prompt, the head's float32 output rows at ``positions(len(prompt))``; prompts
    go together as far as the step's token budget and the free KV blocks allow."""
    kv, budget = engine.scheduler.kv_cache, engine.config.scheduler.max_num_batched_tokens
    results: list[torch.Tensor] = []
    start = 0
    while start < len(prompts):
        requests, rows, picked, tokens = [], [], [], 0
        try:
            for index in range(start, len(prompts)):
                ids = list(prompts[index])
                if len(ids) >= engine.max_model_len:
                    raise InvalidRequest("input", f"an input has {len(ids)} tokens; this model takes at most "
                                                  f"{engine.max_model_len - 1}")
                if requests and tokens + len(ids) > budget:
                    break
                request = Request(f"__forward_{index}__", ids, SamplingParams(), arrival_time=0.0, arrival_index=-1,
                                  eos_token_ids=(), max_model_len=engine.max_model_len)
                if not kv.allocate_slots(request, len(ids)):
                    if not requests:
                        raise InvalidRequest("input", "the KV cache cannot hold this input now")
                    break
                requests.append(request)
                rows.append(Row(ids, 0, list(kv.block_ids(request.request_id))))
                picked.extend(tokens + p for p in positions(len(ids)))
                tokens += len(ids)
            logits = engine.runner.model_step.run(Step(rows, picked, False)).logits
        finally:
            for request in requests:
                kv.free(request)
        offset = 0
        for row in rows:
            count = len(positions(len(row.token_ids)))
            results.append(logits[offset:offset + count])
            offset += count
        start += len(requests)
    return results

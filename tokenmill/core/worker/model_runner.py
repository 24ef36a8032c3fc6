"""One step on the model: SchedulerOutput -> flat tensors -> forward -> sampler.

The runner keeps what it needs per request across steps (sampling params,
output history for penalties, the seeded generator) so the scheduler sends
only per-step deltas. Logits are computed only for rows that sample or that
report prompt logprobs, and not at all where every row takes the argmax of its
raw logits and the platform's greedy head can find it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from tokenmill.core.sample.persistent_batch import PersistentBatch
from tokenmill.core.sample.sampler import Sampler, SamplingRow, gather_logprobs
from tokenmill.core.worker.kv_cache import SwapCaches
from tokenmill.interfaces.adapters import AdapterType
from tokenmill.interfaces.attention import AttentionBackend, AttentionMetadata
from tokenmill.interfaces.batch import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.interfaces.logits_processor import LogitsProcessor
from tokenmill.interfaces.models import CausalLM
from tokenmill.interfaces.platform import GreedyArgmax
from tokenmill.interfaces.types import PositionLogprobs


@dataclass(slots=True)
class _RequestState:
    data: NewRequestData
    generator: Optional[torch.Generator]
    output_token_ids: list[int] = field(default_factory=list)
    #: prompt tokens whose logprobs were already reported (survives preemption)
    num_prompt_logprobs_done: int = 1  # the first prompt token has none


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, block_size: int, seed: int,
                 swap: Optional["SwapCaches"] = None, adapters: Optional[AdapterType] = None,
                 greedy_head: Optional[GreedyArgmax] = None,
                 logits_processors: tuple[LogitsProcessor, ...] = ()) -> None:
        self.model = model
        #: the backend's per-step metadata builder, where it has one (AttentionBackend)
        self._build_metadata = getattr(attention, "build_metadata", None)
        #: tokens for steps whose rows all take the argmax of their raw logits
        self.greedy_head = greedy_head
        self.block_size = block_size
        self.sampler = Sampler(seed, logits_processors)
        self._batch = PersistentBatch()
        self.swap = swap
        self.adapters = adapters
        self._states: dict[str, _RequestState] = {}

    def prepare(self, batch: SchedulerOutput) -> None:
        """The step's bookkeeping before any compute: forget finished requests, keep new
        ones, copy KV blocks to and from the swap space. A failure here is the engine's."""
        # Finished first: a request id may be reused as soon as its request finished.
        for request_id in batch.finished_request_ids:
            self._states.pop(request_id, None)
        # a reused id is a new request: the logits processors must not keep the old one's state
        self._batch.forget(batch.finished_request_ids)
        for data in batch.new_requests:
            generator = None
            if data.seed is not None:
                generator = torch.Generator().manual_seed(data.seed)
            self._states[data.request_id] = _RequestState(data, generator)
        if batch.blocks_to_swap_out or batch.blocks_to_swap_in:
            assert self.swap is not None, "swap requested but no swap space was allocated"
            self.swap.copy(batch.blocks_to_swap_out, to_host=True)
            self.swap.copy(batch.blocks_to_swap_in, to_host=False)

    def generator_states(self, batch: SchedulerOutput) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The random state the step's samples will draw from, to rewind a failed step with."""
        seeded = [self._states[item.request_id].generator for item in batch.scheduled
                  if item.sample and item.request_id in self._states]
        return [(g, g.get_state()) for g in (self.sampler.generator, *filter(None, seeded))]

    @staticmethod
    def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, state in states:
            generator.set_state(state)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """The forward pass and sampling for a prepared batch. Request state changes only once
        the whole step succeeded, so a failed step can be run again (one request at a time)."""
        if batch.is_empty:
            return ModelRunnerOutput({}, {}, {})

        input_ids, positions, metadata = self._prepare_inputs(batch.scheduled)
        if self.adapters is not None:
            self.adapters.prepare_step([self._states[s.request_id].data.adapter_name for s in batch.scheduled],
                                       [len(s.new_token_ids) for s in batch.scheduled])
        hidden = self.model.forward(input_ids, positions, metadata)

        # Rows to compute logits for: prompt-logprob positions, then sampling positions.
        starts = metadata.query_start_loc_cpu
        sample_rows: list[int] = []
        sample_items: list[ScheduledRequest] = []
        prompt_spans: list[tuple[ScheduledRequest, int, int, int]] = []  # item, row0, first token, count
        rows: list[int] = []
        for i, item in enumerate(batch.scheduled):
            state = self._states[item.request_id]
            if state.data.sampling_params.prompt_logprobs is not None:
                span = self._prompt_logprob_span(item, state)
                if span is not None:
                    first, count = span
                    offset = first - 1 - item.num_computed_tokens
                    prompt_spans.append((item, len(rows), first, count))
                    rows.extend(range(starts[i] + offset, starts[i] + offset + count))
            if item.sample:
                sample_rows.append(len(rows))
                sample_items.append(item)
                rows.append(starts[i + 1] - 1)
        if not rows:
            return ModelRunnerOutput({}, {}, {})
        hidden = hidden[torch.tensor(rows)]
        states = [self._states[item.request_id] for item in sample_items]
        self._update_processors(sample_items, states)
        sampling_rows = [SamplingRow(s.data.sampling_params, s.data.prompt_token_ids, s.output_token_ids,
                                     s.generator) for s in states]
        tokens: Optional[list[int]] = None
        token_logprobs: list[Optional[PositionLogprobs]] = [None] * len(sample_items)
        if self.greedy_head is not None and not prompt_spans and self.sampler.argmax_only(sampling_rows):
            tokens = self.greedy_head.tokens(hidden)
        prompt_logprobs: dict[str, list[Optional[PositionLogprobs]]] = {}
        if tokens is None:
            logits = self.model.compute_logits(hidden)
            prompt_logprobs = self._prompt_logprobs(logits, prompt_spans)
            if sample_items:
                if len(sample_rows) < len(rows):
                    logits = logits[torch.tensor(sample_rows)]
                tokens, token_logprobs = self.sampler(logits, sampling_rows)
        for item, _, first, count in prompt_spans:
            self._states[item.request_id].num_prompt_logprobs_done = first + count
        sampled: dict[str, int] = {}
        logprobs: dict[str, PositionLogprobs] = {}
        for item, state, token, entry in zip(sample_items, states, tokens or [], token_logprobs):
            state.output_token_ids.append(token)
            sampled[item.request_id] = token
            if entry is not None:
                logprobs[item.request_id] = entry
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _update_processors(self, items: list[ScheduledRequest], states: list[_RequestState]) -> None:
        update = self._batch.update([(item.request_id, s.data.sampling_params, s.data.prompt_token_ids,
                                      s.output_token_ids) for item, s in zip(items, states)])
        if update is not None:
            self.sampler.update_batch(update)
            self._batch.committed()

    def _prepare_inputs(
        self, scheduled: tuple[ScheduledRequest, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        query_lens = np.fromiter((len(s.new_token_ids) for s in scheduled), np.int64, len(scheduled))
        computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        query_start = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        seq_lens = computed + query_lens
        num_tokens = int(query_start[-1])

        request_index = np.repeat(np.arange(len(scheduled)), query_lens)
        positions = computed[request_index] + np.arange(num_tokens) - query_start[:-1][request_index]
        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_table = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            block_table[i, : len(s.block_ids)] = s.block_ids
        slots = block_table[request_index, positions // bs].astype(np.int64) * bs + positions % bs

        input_ids = torch.tensor(
            [t for s in scheduled for t in s.new_token_ids], dtype=torch.long
        )
        common = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=torch.from_numpy(slots),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=tuple(query_start.tolist()),
            seq_lens_cpu=tuple(seq_lens.tolist()),
            block_size=bs,
        )
        metadata = common if self._build_metadata is None else self._build_metadata(common)
        return input_ids, torch.from_numpy(positions), metadata

    @staticmethod
    def _prompt_logprob_span(item: ScheduledRequest, state: _RequestState) -> Optional[tuple[int, int]]:
        """(first prompt token index, count) whose logprobs this chunk newly yields.

        The logits at position j score token j + 1, so a chunk covering positions
        [s, e) yields prompt tokens s+1 .. min(e, len(prompt) - 1).
        """
        num_prompt = len(state.data.prompt_token_ids)
        end = min(item.num_computed_tokens + len(item.new_token_ids), num_prompt - 1)
        first = max(item.num_computed_tokens + 1, state.num_prompt_logprobs_done)
        if end < first:
            return None
        return first, end - first + 1

    def _prompt_logprobs(
        self, logits: torch.Tensor, spans: list[tuple[ScheduledRequest, int, int, int]]
    ) -> dict[str, list[Optional[PositionLogprobs]]]:
        result: dict[str, list[Optional[PositionLogprobs]]] = {}
        for item, row0, first, count in spans:
            state = self._states[item.request_id]
            targets = torch.tensor(state.data.prompt_token_ids[first:first + count], dtype=torch.long)
            k = state.data.sampling_params.prompt_logprobs
            result[item.request_id] = gather_logprobs(
                logits[row0:row0 + count].log_softmax(dim=-1), targets, [k] * count
            )
        return result

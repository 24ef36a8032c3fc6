"""One step on the driver: SchedulerOutput -> a ``Step`` for the model -> sampler.

The runner keeps what it needs per request across steps (sampling params,
output history for penalties, the seeded generator) so the scheduler sends
only per-step deltas, and it decides which rows need logits before the forward
pass: rows that sample or that report prompt logprobs, and none at all where
every row takes the argmax of its raw logits and the model side can find it
(the platform's greedy head, or the gathered (max, index) of vocabulary shards).
The forward itself is a ``ModelStep``'s: in this process, or on every rank of a
multi-process model.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.sample.drafted_history import DraftedHistory
from tokenmill.core.sample.persistent_batch import PersistentBatch
from tokenmill.core.sample.rejection_sampler import accept_greedy, row_starts, verify
from tokenmill.core.sample.sampler import LogprobValues, Sampler, SamplingRow
from tokenmill.core.worker.input_staging import HostCopies, InputStaging
from tokenmill.core.worker.model_step import ModelStep, StepResult
from tokenmill.core.worker.placeholder_tokens import PlaceholderTokens
from tokenmill.core.worker.prompt_logprobs import PromptLogprobs
from tokenmill.interfaces.batch import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.interfaces.logits_processor import LogitsProcessor
from tokenmill.interfaces.outputs import PositionLogprobs


@dataclass(slots=True)
class _RequestState:
    data: NewRequestData
    generator: Optional[torch.Generator]
    #: whether a logits processor may keep state for this request (``Sampler.processed``)
    processed: bool = True
    output_token_ids: list[int] = field(default_factory=list)
    #: prompt tokens whose logprobs were already reported (survives preemption)
    num_prompt_logprobs_done: int = 1  # the first prompt token has none


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass has started: what sampling it needs once the logits are in."""

    rows: list[int] = field(default_factory=list)
    #: index into ``rows`` of each sampling request's first row (a request with k drafts
    #: has k + 1 consecutive rows)
    sample_rows: list[int] = field(default_factory=list)
    sample_items: list[ScheduledRequest] = field(default_factory=list)
    #: the sampling rows of ``sample_items``, as the logits processors were told them
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    #: (item, first row, first prompt token, count) per prompt-logprob span
    prompt_spans: list[tuple[ScheduledRequest, int, int, int]] = field(default_factory=list)
    step: Optional[Step] = None
    #: the model's result, where the forward pass ran to the end (None: still in the pipeline)
    result: Optional[StepResult] = None
    #: each scheduled request's state at launch: the result reaches only that request (an id
    #: is free again once its request finished, while this step may still be in flight)
    owners: dict[str, "_RequestState"] = field(default_factory=dict)
    #: the samples of ``sample_items``, once the result is in (still on the model's device)
    samples: Optional["_Samples"] = None
    #: the values of ``prompt_spans``, once the result is in
    prompt_logprobs: Optional[PromptLogprobs] = None


@dataclass(slots=True)
class _Samples:
    """A step's samples before the host reads them: a token per request (a tensor on the
    model's device, or the argmax head's list) with its logprob values, or verified drafts."""

    tokens: torch.Tensor | list[int] | None = None
    logprobs: Optional[LogprobValues] = None
    #: per request, the logprobs it asked for (None: none)
    ks: Sequence[Optional[int]] = ()
    verified: Optional[list[tuple[list[int], list[Optional[PositionLogprobs]]]]] = None
    #: ``tokens`` and ``logprobs`` copied to the host as soon as they were sampled (a device
    #: that is not the host), so that reading them waits for this step only
    host: Optional[HostCopies] = None

    def copy_to_host(self, staging: InputStaging) -> None:
        values = self.logprobs
        self.host = staging.to_host([self.tokens] + ([] if values is None else values.tensors()))

    def read(self) -> tuple[list[list[int]], Optional[list[list[Optional[PositionLogprobs]]]]]:
        """Each request's tokens, and their logprob entries (None: no request asked for any),
        on the host: the step's one wait for the device."""
        if self.verified is not None:
            return [tokens for tokens, _ in self.verified], [entries for _, entries in self.verified]
        tokens, values = self.tokens, self.logprobs
        if self.host is not None:
            tokens, *landed = self.host.wait()
            values = values and LogprobValues.of_tensors(landed)
        tokens = tokens if isinstance(tokens, list) else tokens.tolist()
        token_lists = [[token] for token in tokens]
        if values is None:
            return token_lists, None
        return token_lists, [[entry] for entry in values.entries(tokens, self.ks)]


class ModelRunner:
    def __init__(self, model_step: ModelStep, seed: int,
                 logits_processors: tuple[LogitsProcessor, ...] = (), logprobs_mode: str = "raw_logprobs",
                 async_scheduling: bool = False, readback: Optional[InputStaging] = None,
                 device_generator: Callable[[int], Optional[torch.Generator]] = lambda seed: None) -> None:
        #: runs the forward pass: here, or broadcast to every rank first (DistributedModelStep)
        self.model_step = model_step
        #: host buffers for the sampled tokens, where the model runs on another device (the
        #: forward pass's input staging, whose buffers take turns with its steps)
        self._readback = readback
        #: each request's latest sampled token, where it lies on the model's device, for the
        #: placeholders of a step scheduled before that token reached the host (async scheduling)
        self._sampled: Optional[dict[str, tuple[torch.Tensor, int]]] = {} if async_scheduling else None
        #: a generator on the logits' device from a seed (``Platform.noise_generator``), or None
        #: where sampling noise is drawn on the host
        self._device_generator = device_generator
        self.sampler = Sampler(seed, logits_processors, logprobs_mode, device_generator(seed))
        self._batch = PersistentBatch()
        self._states: dict[str, _RequestState] = {}
        #: the launched step whose rows the logits processors hold
        self._processors_hold: Optional[LaunchedStep] = None
        #: numbers the rows that score draft positions, so no two steps share such a row's id
        self._draft_rows = itertools.count()

    @property
    def model(self):
        """The driver rank's model (its shard, under tensor or pipeline parallelism)."""
        return self.model_step.model

    @property
    def greedy_head(self):
        return self.model_step.greedy_head

    def prepare(self, batch: SchedulerOutput) -> None:
        """The step's bookkeeping before any compute: forget finished requests, keep new
        ones, copy KV blocks to and from the swap space. A failure here is the engine's."""
        # Finished first: a request id may be reused as soon as its request finished.
        for request_id in batch.finished_request_ids:
            self._states.pop(request_id, None)
            if self._sampled is not None:
                self._sampled.pop(request_id, None)
        # a request preempted while its step is in flight: that step's result is for a state it
        # no longer has (async scheduling); the same history, a new owner
        for request_id in batch.preempted_request_ids:
            state = self._states.get(request_id)
            if state is not None and self._sampled is not None:
                self._states[request_id] = dataclasses.replace(state)
                self._sampled.pop(request_id, None)
        # a reused id is a new request: the logits processors must not keep the old one's state
        self._batch.forget(batch.finished_request_ids)
        for data in batch.new_requests:
            generator = None
            if data.seed is not None:  # its draws are made where the engine's noise is drawn
                generator = self._device_generator(data.seed) or torch.Generator().manual_seed(data.seed)
            self._states[data.request_id] = _RequestState(data, generator,
                                                          self.sampler.processed(data.sampling_params))
        if batch.blocks_to_swap_out or batch.blocks_to_swap_in:
            self.model_step.swap_blocks(batch.blocks_to_swap_out, batch.blocks_to_swap_in)

    def generator_states(self, batch: SchedulerOutput) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The random state the step's samples will draw from, to rewind a failed step with."""
        seeded = [self._states[item.request_id].generator for item in batch.scheduled
                  if item.sample and item.request_id in self._states]
        return [(g, g.get_state()) for g in (*self.sampler.generators, *filter(None, seeded))]

    @staticmethod
    def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, state in states:
            generator.set_state(state)

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """The forward pass and sampling for a prepared batch. Request state changes only once
        the whole step succeeded, so a failed step can be run again (one request at a time)."""
        return self.finish(self.launch(batch, wait=True))

    def launch(self, batch: SchedulerOutput, wait: bool = False) -> "LaunchedStep":
        """Decide the step's logits rows, and start its forward pass: to completion with
        ``wait``, else until this process's pipeline stage is done (``finish`` takes the rest)."""
        # Rows to compute logits for: prompt-logprob positions, then sampling positions.
        start = 0
        launched = LaunchedStep()
        rows = launched.rows
        for item in batch.scheduled:
            state = self._states[item.request_id]
            if state.data.sampling_params.prompt_logprobs is not None:
                span = self._prompt_logprob_span(item, state)
                if span is not None:
                    first, count = span
                    offset = first - 1 - item.num_computed_tokens
                    launched.prompt_spans.append((item, len(rows), first, count))
                    rows.extend(range(start + offset, start + offset + count))
            start += len(item.new_token_ids)
            if item.sample:
                launched.sample_rows.append(len(rows))
                launched.sample_items.append(item)
                rows.extend(range(start - 1 - len(item.spec_token_ids), start))
        if batch.is_empty:
            return launched
        launched.sampling_rows = self._update_processors(launched.sample_items)
        self._processors_hold = launched
        states = self._states
        launched.owners = {item.request_id: states[item.request_id] for item in batch.scheduled}
        greedy = (bool(rows) and not launched.prompt_spans and self.sampler.argmax_only(launched.sampling_rows)
                  and (self.greedy_head is not None or self.model_step.parallel.world_size > 1))
        launched.step = Step([Row(item.new_token_ids, item.num_computed_tokens, item.block_ids,
                                  states[item.request_id].data.adapter_name) for item in batch.scheduled],
                             rows, greedy)
        launched.result = self.model_step.run(launched.step, wait, self._placeholders(batch))
        if launched.result is not None:
            self._sample(launched)
        return launched

    def _placeholders(self, batch: SchedulerOutput) -> Optional[PlaceholderTokens]:
        """Where the step's placeholder tokens come from: the tokens its requests' last step
        sampled, still on the device (async scheduling)."""
        if self._sampled is None:
            return None
        rows, sources, start = [], [], 0
        for item in batch.scheduled:
            if item.new_token_ids[0] == PLACEHOLDER_TOKEN:
                rows.append(start)
                sources.append(self._sampled[item.request_id])
            start += len(item.new_token_ids)
        return PlaceholderTokens(rows, sources) if rows else None

    def _sample(self, launched: "LaunchedStep") -> None:
        """Sample the launched step's rows from its result. The tokens stay on the model's
        device (``finish`` reads them), so that another step can be launched first."""
        result, items = launched.result, launched.sample_items
        if launched.prompt_spans and result.logits is not None:
            owners = launched.owners
            launched.prompt_logprobs = PromptLogprobs.of(result.logits, [
                (item.request_id, row, owners[item.request_id].data.prompt_token_ids[first:first + count],
                 owners[item.request_id].data.sampling_params.prompt_logprobs)
                for item, row, first, count in launched.prompt_spans])
            if self._readback is not None:
                launched.prompt_logprobs.copy_to_host(self._readback)
        drafts = [item.spec_token_ids for item in items]
        row_index = [row + j for item, row in zip(items, launched.sample_rows)
                     for j in range(len(item.spec_token_ids) + 1)]
        samples = launched.samples = _Samples()
        if not items:
            samples.verified = []
        elif result.tokens is not None:
            targets = [result.tokens[row] for row in row_index]
            if not any(drafts):  # one row, one token per request
                samples.tokens = targets
            else:
                starts = row_starts(drafts)
                samples.verified = [(tokens, [None] * len(tokens)) for tokens in (
                    accept_greedy(targets[start:end], request_drafts)
                    for request_drafts, start, end in zip(drafts, starts, starts[1:]))]
        else:
            logits = result.logits
            if len(row_index) < len(launched.rows):  # the sampling rows among prompt-logprob ones
                index = np.asarray(row_index, dtype=np.int64)
                logits = logits[torch.from_numpy(index) if self._readback is None
                                else self._readback.to_device("sampling_rows", index)]
            if any(drafts):
                samples.verified = [(v.token_ids, v.logprobs)
                                    for v in verify(self.sampler, logits, launched.sampling_rows, drafts)]
            else:
                samples.tokens, samples.logprobs = self.sampler.sample(logits, launched.sampling_rows)
                if samples.logprobs is not None:
                    samples.ks = [row.params.logprobs for row in launched.sampling_rows]
        if self._readback is not None and isinstance(samples.tokens, torch.Tensor):
            samples.copy_to_host(self._readback)
        # what the step needs of its logits is taken: they go now, not with the step (under
        # async scheduling, after the next step's forward pass: a prompt chunk's are [tokens, vocab])
        launched.result = dataclasses.replace(result, logits=None)
        if self._sampled is not None and samples.tokens is not None:
            tokens = samples.tokens
            if isinstance(tokens, list):
                tokens = torch.tensor(tokens)
            for index, item in enumerate(items):
                self._sampled[item.request_id] = (tokens, index)

    def finish(self, launched: "LaunchedStep") -> ModelRunnerOutput:
        """Read a launched step's samples on the host, and apply them to its requests: its
        result from the last pipeline stage first if it is not in yet."""
        if launched.step is None or not launched.rows:
            return ModelRunnerOutput({}, {}, {})
        owners = launched.owners
        if launched.samples is None:
            launched.result = self.model_step.receive(launched.step)
            # a request aborted while its step was in flight has no state left to advance
            kept = [(item, row) for item, row in zip(launched.sample_items, launched.sample_rows)
                    if self._states.get(item.request_id) is owners[item.request_id]]
            if len(kept) < len(launched.sample_items) or self._processors_hold is not launched:
                # the processors were told of the steps launched since: tell them this one's rows again
                launched.sample_items = [item for item, _ in kept]
                launched.sample_rows = [row for _, row in kept]
                launched.sampling_rows = self._update_processors(launched.sample_items)
                self._processors_hold = launched
            self._sample(launched)
        spans = [span for span in launched.prompt_spans
                 if self._states.get(span[0].request_id) is owners[span[0].request_id]]
        prompt_logprobs = {}
        if launched.prompt_logprobs is not None:
            live = {item.request_id for item, *_ in spans}
            prompt_logprobs = {request_id: entries for request_id, entries in launched.prompt_logprobs.read().items()
                               if request_id in live}
        for item, _, first, count in spans:
            self._states[item.request_id].num_prompt_logprobs_done = first + count
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[Optional[PositionLogprobs]]] = {}
        token_lists, entry_lists = launched.samples.read()
        states = self._states
        for index, item in enumerate(launched.sample_items):
            request_id = item.request_id
            state = owners[request_id]
            if states.get(request_id) is not state:
                continue
            tokens = token_lists[index]
            state.output_token_ids.extend(tokens)
            sampled[request_id] = tokens
            if entry_lists is not None and entry_lists[index][0] is not None:
                logprobs[request_id] = entry_lists[index]
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _sampling_rows(self, items: list[ScheduledRequest]) -> list[SamplingRow]:
        """One row per position to sample: a request with k drafts has k + 1, the j-th with
        the first j drafts appended to its history, as if they had been generated."""
        rows = []
        for item in items:
            state = self._states[item.request_id]
            params, prompt, output = state.data.sampling_params, state.data.prompt_token_ids, state.output_token_ids
            rows.append(SamplingRow(params, prompt, output, state.generator))
            for j in range(1, len(item.spec_token_ids) + 1):
                history = DraftedHistory(output, item.spec_token_ids[:j])
                rows.append(SamplingRow(params, prompt, history, state.generator))
        return rows

    def _update_processors(self, items: list[ScheduledRequest]) -> list[SamplingRow]:
        """Tell the logits processors this step's sampling rows (returned). The rows of draft
        positions get ids of their own, new every step: a processor builds their state from
        their history, as for a request resumed after preemption."""
        rows = self._sampling_rows(items)
        ids = []
        for item in items:
            ids.append(item.request_id)
            ids.extend(f"{item.request_id}\x00draft{next(self._draft_rows)}" for _ in item.spec_token_ids)
        update = self._batch.update(ids, rows, any(self._states[item.request_id].processed for item in items))
        if update is not None:
            self.sampler.update_batch(update)
            self._batch.committed()
        return rows

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

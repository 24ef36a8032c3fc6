"""Turning a batch of logits into tokens, each row with its own SamplingParams.

Order follows vLLM: the logits processors that can move the argmax (allowed_token_ids,
bad_words, min_tokens, logit_bias, a plugin's), then penalties, then greedy argmax
or temperature -> the argmax-invariant processors -> min-p -> top-k/top-p -> a draw.
Reported logprobs are those of the raw distribution, or (``logprobs_mode``, vLLM's
engine option) the raw logits, or the logprobs or logits of the distribution the token was
drawn from: after the processors, penalties, temperature, min-p, top-k and top-p
(``processed_*``: the ratios GRPO's importance weights need). A seeded row draws only from
its own generator, so its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.sample.device_tokens import DeviceTokens
from tokenmill.interfaces.logits_processor import BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.outputs import Logprob, PositionLogprobs
from tokenmill.interfaces.sampling_params import ALL_TOKENS, SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of the batch: the request's parameters and the history penalties need."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: Optional[torch.Generator]


class Sampler:
    def __init__(self, seed: int, processors: Sequence[LogitsProcessor] = (),
                 logprobs_mode: str = "raw_logprobs", noise_generator: Optional[torch.Generator] = None) -> None:
        self.logprobs_mode = logprobs_mode
        #: host draws for unseeded rows; seeded from the engine seed for reproducible runs
        self.generator = torch.Generator().manual_seed(seed)
        #: where set (``Platform.noise_generator``), the unseeded rows' sampling noise is drawn
        #: with it on the logits' device instead, not on the host and copied there
        self.noise_generator = noise_generator
        self.processors = tuple(processors)
        #: penalised requests' prompt and output ids, on the logits' device
        self._prompt_tokens = DeviceTokens()
        self._output_tokens = DeviceTokens()
        self._argmax_changing = [p for p in self.processors if not p.is_argmax_invariant()]
        self._argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]

    def processed(self, params: SamplingParams) -> bool:
        """Whether any logits processor may keep state for a request with these parameters."""
        return any(processor.applies_to(params) for processor in self.processors)

    def update_batch(self, update: Optional[BatchUpdate]) -> None:
        """Tell every processor how the rows changed since the last step."""
        for processor in self.processors:
            processor.update_state(update)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[list[int], list[Optional[PositionLogprobs]]]:
        """``logits`` [num_rows, vocab] float32 -> (token ids, per-row logprobs or None)."""
        tokens, values = self.sample(logits, rows)
        token_list = tokens.tolist()
        if values is None:
            return token_list, [None] * len(rows)
        return token_list, values.entries(token_list, [row.params.logprobs for row in rows])

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
               ) -> tuple[torch.Tensor, Optional["LogprobValues"]]:
        """The rows' tokens and, where a row asks for logprobs, their values: tensors on the
        logits' device, computed without waiting for it (the caller reads them later)."""
        processed, greedy = self.process(logits, rows)
        tokens = processed.argmax(dim=-1)  # the greedy rows' tokens; the sampling rows' are drawn
        random_index = [i for i, g in enumerate(greedy) if not g]
        if random_index:
            index = on_device(logits.device, random_index, torch.long)
            tokens[index] = self.draw(processed[index].softmax(dim=-1), [rows[i].generator for i in random_index])
        ks = [row.params.logprobs for row in rows]
        if all(k is None for k in ks):
            return tokens, None
        return tokens, LogprobValues.of(self.reported(logits, processed), tokens, ks)

    def reported(self, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        """The values logprobs report, per ``logprobs_mode`` (ranks follow them too)."""
        source = raw if self.logprobs_mode.startswith("raw") else processed
        return source.log_softmax(dim=-1) if self.logprobs_mode.endswith("logprobs") else source

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, list[bool]]:
        """Each row's final logits and whether it is greedy: a greedy row's token is their
        argmax; a sampling row's distribution is their softmax (temperature, min-p, top-k and
        top-p applied). ``logits`` is left as it was."""
        active = [p for p in self._argmax_changing if p.is_active()]
        if active:
            logits = logits.clone()  # the processors may edit in place; the caller's logits stay raw
            for processor in active:
                logits = processor.apply(logits)
        logits = self._apply_penalties(logits, rows)
        greedy = [row.params.greedy for row in rows]
        if all(greedy):
            return logits, greedy
        temperatures = [row.params.temperature or 1.0 for row in rows]
        temperature = on_device(logits.device, temperatures, logits.dtype).unsqueeze(1)
        logits = logits / temperature
        for processor in self._argmax_invariant:
            if processor.is_active():
                logits = processor.apply(logits)
        random_index = [i for i, g in enumerate(greedy) if not g]
        random_rows = [rows[i] for i in random_index]
        index = on_device(logits.device, random_index, torch.long)
        logits[index] = self._truncate(logits[index], random_rows)
        return logits, greedy

    def argmax_only(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether each row's token is the argmax of its raw logits and nothing else of
        them is reported, so the logits themselves need not be computed (GreedyHead).
        Call after ``update_batch`` for these rows."""
        return (all(row.params.greedy and row.params.logprobs is None and not _penalized(row.params)
                    for row in rows)
                and not any(p.is_active() for p in self._argmax_changing))

    @staticmethod
    def _truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """min-p, then top-k and top-p, on logits already divided by each row's temperature."""
        if any(row.params.min_p > 0 for row in rows):
            min_p = on_device(logits.device, [row.params.min_p for row in rows], logits.dtype)
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return apply_top_k_top_p(
            logits,
            [row.params.top_k for row in rows],
            [row.params.top_p for row in rows],
        )

    @property
    def generators(self) -> tuple[torch.Generator, ...]:
        """The engine's generators a step may advance (to rewind a failed step)."""
        return (self.generator,) if self.noise_generator is None else (self.generator, self.noise_generator)

    def draw(self, probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
        """One token from each row of ``probs``, with the row's generator (None: the engine's).

        The exponential race: argmax(p / q) with q ~ Exp(1) samples from p, and lets each
        seeded row draw q from its own generator. Where the sampler has a ``noise_generator``
        (a device's), every row's q is drawn on ``probs``' device, a seeded row's with its
        request's generator, which the runner made on that device too (vLLM's rule: a seeded
        request samples alike on the same device, whatever its batch); otherwise on the host."""
        device, vocab = probs.device, probs.shape[1]
        unseeded = [i for i, generator in enumerate(generators) if generator is None]
        if len(unseeded) == len(generators):
            return (probs / self._noise(len(unseeded), probs)).argmax(dim=-1)
        q = torch.empty_like(probs)
        if unseeded:
            q[on_device(device, unseeded, torch.long)] = self._noise(len(unseeded), probs)
        seeded = [i for i, generator in enumerate(generators) if generator is not None]
        at = self.seeded_device(device)
        q[on_device(device, seeded, torch.long)] = on_device(device, torch.stack(
            [torch.empty(vocab, dtype=probs.dtype, device=at).exponential_(generator=generators[i]) for i in seeded]))
        return (probs / q).argmax(dim=-1)

    def seeded_device(self, device: torch.device) -> Optional[torch.device]:
        """Where a seeded request's generator draws: on ``device`` (the logits') where the
        sampler draws its noise there (the runner made the request's generator there), else on
        the host (None)."""
        return device if self.noise_generator is not None else None

    def _noise(self, rows: int, probs: torch.Tensor) -> torch.Tensor:
        """Exp(1) draws for ``rows`` unseeded rows, on ``probs``' device."""
        if self.noise_generator is not None:
            return torch.empty(rows, probs.shape[1], dtype=probs.dtype, device=probs.device).exponential_(
                generator=self.noise_generator)
        return on_device(probs.device, torch.empty(rows, probs.shape[1], dtype=probs.dtype).exponential_(
            generator=self.generator))

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Repetition (vLLM/HF: every token seen in the prompt or the output), frequency and
        presence penalties, for all penalised rows in a few batched tensor operations over the
        (row, token) pairs seen, not over [rows, vocab] (a dozen passes over 256 x 32k logits
        took 200+ ms a step on a CPU core). A pair seen twice is written twice, with one value."""
        penalized = [i for i, row in enumerate(rows) if _penalized(row.params)]
        if not penalized:
            return logits
        logits = logits.clone(memory_format=torch.contiguous_format)
        device, vocab = logits.device, logits.shape[1]
        params = [rows[i].params for i in penalized]
        out_rows, out_ids = self._output_tokens.ids([rows[i].output_token_ids for i in penalized], device)
        repeating = any(p.repetition_penalty != 1.0 for p in params)
        seen_rows, seen_ids = out_rows, out_ids  # (penalised row, token) pairs
        if repeating:
            prompt_rows, prompt_ids = self._prompt_tokens.ids([rows[i].prompt_token_ids for i in penalized], device)
            seen_rows, seen_ids = torch.cat([prompt_rows, out_rows]), torch.cat([prompt_ids, out_ids])
        # flat indices: one index tensor gathers and scatters faster than a (row, token) pair of them
        counts = torch.zeros(len(penalized) * vocab, dtype=logits.dtype, device=device)
        counts.index_put_((out_rows * vocab + out_ids,), torch.ones(len(out_ids), dtype=logits.dtype, device=device),
                          accumulate=True)
        at = on_device(device, penalized, torch.long)[seen_rows] * vocab + seen_ids
        flat = logits.view(-1)
        values = flat[at]
        if repeating:
            repetition = on_device(device, [p.repetition_penalty for p in params], logits.dtype)[seen_rows]
            values = torch.where(values > 0, values / repetition, values * repetition)
        frequency = on_device(device, [p.frequency_penalty for p in params], logits.dtype)[seen_rows]
        presence = on_device(device, [p.presence_penalty for p in params], logits.dtype)[seen_rows]
        seen = counts[seen_rows * vocab + seen_ids]
        flat[at] = values - (frequency * seen + presence * (seen > 0))
        return logits


def reads_output_history(params: SamplingParams) -> bool:
    """Whether sampling a request's next token reads the tokens it generated so far (penalties,
    min_tokens, bad_words, a grammar, a plugin's processor through ``extra_args``): under async
    scheduling such a request waits for its last token to reach the host."""
    return (_penalized(params) or params.min_tokens > 0 or bool(params.bad_words)
            or params.structured_outputs is not None or bool(params.extra_args))


def _penalized(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf."""
    vocab = logits.shape[1]
    top_k = [vocab if v == ALL_TOKENS else min(v, vocab) for v in top_k]
    if all(v == vocab for v in top_k) and all(v >= 1.0 for v in top_p):
        return logits
    k = on_device(logits.device, top_k, torch.long)
    p = on_device(logits.device, top_p, logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - p).unsqueeze(1)
    outside[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass(slots=True)
class LogprobValues:
    """What logprobs report for a batch of rows, still on the device: the chosen tokens'
    values and ranks, and each row's top-k (k: the largest any row asked for)."""

    chosen: torch.Tensor  # [n]
    ranks: torch.Tensor  # [n]
    top_values: Optional[torch.Tensor]  # [n, k]
    top_ids: Optional[torch.Tensor]

    @classmethod
    def of(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[Optional[int]]) -> "LogprobValues":
        """``logprobs`` [n, vocab] (log-softmax, or what logprobs_mode reports), ``token_ids`` [n]."""
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
        ranks = (logprobs > chosen).sum(dim=1) + 1
        max_k = max((k for k in ks if k is not None), default=0)
        top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        return cls(chosen.squeeze(1), ranks, top_values, top_ids)

    def tensors(self) -> list[torch.Tensor]:
        """The values as a list (``of_tensors`` takes it back)."""
        return [self.chosen, self.ranks] + ([] if self.top_values is None else [self.top_values, self.top_ids])

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor]) -> "LogprobValues":
        chosen, ranks, *top = tensors
        return cls(chosen, ranks, *(top or (None, None)))

    def entries(self, token_ids: Sequence[int], ks: Sequence[Optional[int]]) -> list[Optional[PositionLogprobs]]:
        """Per row: ``{token: Logprob}`` for its token and its top-k (vLLM's shape); reads the device."""
        chosen_l, ranks_l = self.chosen.tolist(), self.ranks.tolist()
        top_v = self.top_values.tolist() if self.top_values is not None else None
        top_i = self.top_ids.tolist() if self.top_ids is not None else None
        result: list[Optional[PositionLogprobs]] = []
        for i, k in enumerate(ks):
            if k is None:
                result.append(None)
                continue
            entry = {token_ids[i]: Logprob(chosen_l[i], ranks_l[i])}
            for rank in range(k):
                token = top_i[i][rank]
                if token not in entry:
                    entry[token] = Logprob(top_v[i][rank], rank + 1)
            result.append(entry)
        return result


def gather_logprobs(
    logprobs: torch.Tensor,  # [n, vocab] log-softmax
    token_ids: torch.Tensor,  # [n] the tokens to report
    ks: Sequence[Optional[int]],  # per row: top-k to add, None = report nothing
) -> list[Optional[PositionLogprobs]]:
    """Per row: ``{token: Logprob}`` for the given token and the row's top-k (vLLM's shape)."""
    return LogprobValues.of(logprobs, token_ids, ks).entries(token_ids.tolist(), ks)

"""A step's prompt logprobs: computed on the model's device as soon as its logits are in,
and read on the host with its sampled tokens.

Reading them later, from the logits (``.tolist()`` of device values), would wait for
whatever the device was given since: with async scheduling, the next step's forward pass.
So the values (each prompt token's logprob and rank, each position's top-k) go to the host
with one set of non-blocking copies, and the host turns them into entries once the step's
mark is reached. The log-softmax runs over at most ``CHUNK`` rows at a time: a prompt chunk
of 8k tokens over a 152k vocabulary is 5 GB of fp32 logits, and a log-softmax of all of
them at once would be another 5 GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.sample.sampler import LogprobValues
from tokenmill.core.worker.input_staging import HostCopies, InputStaging
from tokenmill.interfaces.logits_processor import on_device
from tokenmill.interfaces.outputs import PositionLogprobs

#: logits rows per log-softmax
CHUNK = 1024


@dataclass(slots=True)
class PromptLogprobs:
    #: (request id, prompt tokens) per span, in the values' row order
    spans: list[tuple[str, int]]
    targets: list[int]
    #: per row: the top-k the request asked for
    ks: list[int]
    values: LogprobValues
    host: Optional[HostCopies] = None

    @classmethod
    def of(cls, logits: torch.Tensor, spans: Sequence[tuple[str, int, Sequence[int], int]]) -> "PromptLogprobs":
        """``spans``: (request id, first logits row, the prompt tokens those rows score, top-k)."""
        targets = [token for _, _, tokens, _ in spans for token in tokens]
        ks = [k for _, _, tokens, k in spans for _ in tokens]
        top = [max(ks)] * CHUNK
        target_ids = on_device(logits.device, targets, torch.long)
        parts, done = [], 0
        for _, row, tokens, _ in spans:
            for start in range(0, len(tokens), CHUNK):
                count = min(CHUNK, len(tokens) - start)
                rows = logits[row + start:row + start + count]
                parts.append(LogprobValues.of(rows.log_softmax(dim=-1), target_ids[done:done + count], top[:count]))
                done += count
        values = LogprobValues.of_tensors([torch.cat(column) for column in zip(*(p.tensors() for p in parts))])
        return cls([(request_id, len(tokens)) for request_id, _, tokens, _ in spans], targets, ks, values)

    def copy_to_host(self, staging: InputStaging) -> None:
        self.host = staging.to_host(self.values.tensors(), name="prompt_logprobs")

    def read(self) -> dict[str, list[Optional[PositionLogprobs]]]:
        """Each span's entries, by request (waits for the step's copies only)."""
        values = self.values if self.host is None else LogprobValues.of_tensors(self.host.wait())
        entries = values.entries(self.targets, self.ks)
        result, start = {}, 0
        for request_id, count in self.spans:
            result[request_id] = entries[start:start + count]
            start += count
        return result

"""The input tokens of a step that was scheduled before the step in flight had sampled them.

Under async scheduling a decoding request's next step is built while its last step still
runs, so its input token is ``PLACEHOLDER_TOKEN`` on the host; that token exists only on the
model's device, in the last step's sampled tokens. The step's input ids are copied to the
device as usual, then each placeholder row takes its token there, by a device-side gather:
the host never waits for the step before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.core.worker.decode_graphs import Put


@dataclass(frozen=True, slots=True)
class PlaceholderTokens:
    #: flat token indices in the step's input ids that hold a placeholder
    rows: list[int]
    #: for each, (the sampled tokens of the step that produced it, its index there)
    sources: list[tuple[torch.Tensor, int]]

    def fill(self, input_ids: torch.Tensor, put: Put) -> None:
        """Write the tokens into ``input_ids`` (on the device) at ``rows``: one gather and one
        scatter per tensor of sampled tokens (usually one: the last step's)."""
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for row, (tokens, index) in zip(self.rows, self.sources):
            group = groups.setdefault(id(tokens), (tokens, [], []))
            group[1].append(row)
            group[2].append(index)
        for number, (tokens, rows, indices) in enumerate(groups.values()):
            into = put(np.asarray(rows, dtype=np.int64), f"placeholder_rows{number}")
            taken = tokens.to(input_ids.device).index_select(0, put(np.asarray(indices, dtype=np.int64),
                                                                     f"placeholder_index{number}"))
            input_ids.index_copy_(0, into, taken.to(input_ids.dtype))

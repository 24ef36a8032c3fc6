"""How often each token occurs in each penalised row's output and prompt, on the logits'
device, for the frequency, presence and repetition penalties.

The repetition penalty applies to every token seen in the prompt, so each step counts the
prompt tokens of each penalised row. Flattened from the host's lists and copied every step,
that is O(prompt tokens of the batch) of Python and a copy a step (64 rows of 2k-token
prompts: 128k ids, several milliseconds, longer than a GPU's decode step). A request's prompt
is one list for its life, so its ids are kept on the device under that list, for as long as
its rows came up in this call or the last one (requests that read their history take every
other step under async scheduling).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tokenmill.interfaces.logits_processor import on_device


class PromptTokens:
    def __init__(self) -> None:
        #: id of a prompt list -> (the list, kept so its id names it alone; its ids on the device)
        self._this_call: dict[int, tuple[Sequence[int], torch.Tensor]] = {}
        self._last_call: dict[int, tuple[Sequence[int], torch.Tensor]] = {}

    def counts(self, prompts: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
        """[len(prompts), vocab] in ``like``'s dtype and device: how often each token occurs
        in each prompt."""
        device, now = like.device, {}
        for prompt in prompts:
            key = id(prompt)
            # a kept entry holds its list alive, so no other list can have its id meanwhile
            entry = now.get(key) or self._this_call.get(key) or self._last_call.get(key)
            now[key] = entry or (prompt, on_device(device, prompt, torch.long))
        self._last_call = {key: entry for key, entry in self._this_call.items() if key not in now}
        self._this_call = now
        lengths = [len(prompt) for prompt in prompts]
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                       on_device(device, lengths, torch.long), output_size=sum(lengths))
        return _scattered(rows, torch.cat([now[id(prompt)][1] for prompt in prompts]), like)


def token_counts(token_lists: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    """[len(token_lists), vocab] in ``like``'s dtype and device: how often each token occurs in
    each list (the outputs: they grow every step)."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return _scattered(on_device(like.device, rows), on_device(like.device, ids), like)


def _scattered(rows: torch.Tensor, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    counts = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return counts.index_put_((rows, ids), torch.ones(len(ids), dtype=like.dtype, device=like.device), accumulate=True)

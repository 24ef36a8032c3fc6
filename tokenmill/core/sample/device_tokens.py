"""The ids of each penalised row's output and prompt, on the logits' device, for the
frequency, presence and repetition penalties.

Flattened from the host's lists and copied every step, the ids would cost O(tokens of the
batch) of Python a step: 64 rows of 2k-token prompts are 128k ids, 1024 rows of 1k outputs
140 ms, several times a GPU's decode step (and a CPU's at small models). A request's prompt
is one list for its life and its output one list that only grows, so each list's ids are kept
on the device under it, for as long as its rows came up in this call or the last one
(requests that read their history take every other step under async scheduling): a prompt
crosses once, an output's new ids each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.sample.drafted_history import DraftedHistory
from tokenmill.interfaces.logits_processor import on_device


@dataclass(slots=True)
class _Kept:
    #: the list, kept so that its id names it alone
    tokens: Sequence[int]
    #: its first ``length`` ids, on the device (the rest is room to grow)
    ids: torch.Tensor
    length: int


class DeviceTokens:
    def __init__(self) -> None:
        #: id of a token list -> what of it is on the device
        self._this_call: dict[int, _Kept] = {}
        self._last_call: dict[int, _Kept] = {}

    def ids(self, lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every list's ids on ``device``, concatenated, and the index of the list each came
        from. A ``DraftedHistory`` gives its output's kept ids, then its drafts."""
        now: dict[int, _Kept] = {}
        parts, lengths = [], []
        for tokens in lists:
            drafts: Sequence[int] = ()
            if isinstance(tokens, DraftedHistory):
                tokens, drafts = tokens.output, tokens.drafts
            key = id(tokens)
            # a kept entry holds its list alive, so no other list can have its id meanwhile
            kept = _caught_up(now.get(key) or self._this_call.get(key) or self._last_call.get(key), tokens, device)
            now[key] = kept
            parts.append(kept.ids[:kept.length])
            if drafts:
                parts.append(on_device(device, drafts, torch.long))
            lengths.append(kept.length + len(drafts))
        self._last_call = {key: kept for key, kept in self._this_call.items() if key not in now}
        self._this_call = now
        rows = torch.repeat_interleave(torch.arange(len(lists), device=device),
                                       on_device(device, lengths, torch.long), output_size=sum(lengths))
        return rows, torch.cat(parts)


def _caught_up(kept: Optional[_Kept], tokens: Sequence[int], device: torch.device) -> _Kept:
    """``kept`` holding all of ``tokens``: the ids appended since copied (a list that shrank,
    which no request's does, starts over)."""
    if kept is None or len(tokens) < kept.length:
        kept = _Kept(tokens, torch.empty(len(tokens), dtype=torch.long, device=device), 0)
    if len(tokens) > kept.length:
        if len(tokens) > kept.ids.numel():  # room for as many again: a copy per doubling
            grown = torch.empty(2 * len(tokens), dtype=torch.long, device=device)
            grown[:kept.length] = kept.ids[:kept.length]
            kept.ids = grown
        kept.ids[kept.length:len(tokens)] = on_device(device, tokens[kept.length:], torch.long)
        kept.length = len(tokens)
    return kept

"""A verify step's history for the row of draft position j: the request's output, then its
first j drafts, as one sequence, without copying the output (a list of a long request's
tokens per draft row and step would be O(output) of Python each time)."""

from __future__ import annotations

from typing import Sequence, overload


class DraftedHistory(Sequence[int]):
    """``output`` (the request's live list) followed by ``drafts``."""

    __slots__ = ("output", "drafts")

    def __init__(self, output: Sequence[int], drafts: Sequence[int]) -> None:
        self.output = output
        self.drafts = drafts

    def __len__(self) -> int:
        return len(self.output) + len(self.drafts)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("history index out of range")
        size = len(self.output)
        return self.output[index] if index < size else self.drafts[index - size]

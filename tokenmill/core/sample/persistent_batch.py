"""The sampling rows of consecutive steps, as the changes logits processors follow."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from tokenmill.core.sample.sampler import SamplingRow
from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate


def _added(index: int, row: SamplingRow) -> AddedRow:
    return AddedRow(index, row.params, row.prompt_token_ids, row.output_token_ids)


class PersistentBatch:
    """Which request sits in which sampling row; each step's new order becomes a BatchUpdate."""

    def __init__(self) -> None:
        #: the request in each row of the last batch (None: finished since)
        self._ids: list[Optional[str]] = []
        #: after a processor failed mid-update its state is unknown: the next update rebuilds it
        self._indices_in_doubt = 0
        #: whether the last batch the processors were told of has a row that applies to one
        self._told_processed = False
        #: batches went by untold since: the next one told is told in full
        self._untold = False

    def update(self, ids: list[str], rows: Sequence[SamplingRow], processed: bool = True) -> Optional[BatchUpdate]:
        """``ids`` and ``rows`` (params, prompt ids, live output ids) in this step's order;
        ``processed``: whether a row's request applies to a processor (``Sampler.processed``).
        None when nothing changed, or when no processor holds state and none would take any
        for these rows: most steps, which then read nothing of ``rows``."""
        # no processor holds state for any row: the last batch told had none, and they took it
        if not processed and not self._told_processed and not self._indices_in_doubt:
            self._ids, self._untold = ids, True
            return None
        if ids == self._ids and not self._indices_in_doubt and not self._untold:
            return None
        if self._indices_in_doubt or self._untold:
            removed = tuple(range(self._indices_in_doubt))
            moved: tuple[tuple[int, int], ...] = ()
            added = tuple(_added(j, row) for j, row in enumerate(rows))
        else:
            old = {request_id: i for i, request_id in enumerate(self._ids) if request_id is not None}
            kept = set(ids)
            removed = tuple(i for i, request_id in enumerate(self._ids) if request_id is None or request_id not in kept)
            moved = tuple((old[request_id], j) for j, request_id in enumerate(ids)
                          if request_id in old and old[request_id] != j)
            added = tuple(_added(j, row) for j, (request_id, row) in enumerate(zip(ids, rows)) if request_id not in old)
        # until the processors confirm (``committed``), any index either batch used may hold state
        self._indices_in_doubt = max(len(self._ids), len(ids), self._indices_in_doubt)
        self._ids, self._told_processed, self._untold = ids, processed, False
        return BatchUpdate(len(ids), removed, moved, added)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Finished requests: their rows are removed at the next update, even if a new request
        with the same id takes the same row."""
        finished = set(request_ids)
        if finished & set(self._ids):
            self._ids = [None if request_id in finished else request_id for request_id in self._ids]

    def committed(self) -> None:
        """Every processor took the last update."""
        self._indices_in_doubt = 0

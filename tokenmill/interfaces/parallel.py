"""Where one rank of a model sits: its tensor-parallel shard and its pipeline stage.

Models and layers read a ``ParallelContext`` to build their slice of the weights (a
column-parallel linear keeps ``1 / tp_size`` of its outputs, a stage keeps its layers)
and do their collectives through ``comm``. A single-process engine has ``SINGLE``:
every layer then behaves exactly as an unsharded one, with no collective at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


class Communicator(Protocol):
    """The collectives a model needs, over torch.distributed process groups."""

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (or with ``op="max"`` the maximum) over this stage's tensor-parallel ranks,
        in place where it can."""

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        """Vocab-sharded ``[n, shard]`` logits -> ``[n, vocab_size]`` on the stage's first
        tensor-parallel rank; None on the others."""

    def argmax_vocab(self, local: torch.Tensor, vocab_start: int) -> Optional[torch.Tensor]:
        """The argmax over the whole vocabulary from vocab-sharded logits, by gathering each
        shard's (max, index) pair, never the logits: ``[n]`` token ids on the stage's first
        tensor-parallel rank; None on the others."""

    def send_next(self, x: torch.Tensor) -> None:
        """Hidden states to the same tensor-parallel rank of the next pipeline stage."""

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Hidden states from the same tensor-parallel rank of the previous stage."""


@dataclass(frozen=True)
class ParallelContext:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    #: None when the engine runs in one process (every collective is then the identity)
    comm: Optional[Communicator] = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """The global rank: stages are consecutive blocks of ``tp_size`` ranks."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this stage holds: contiguous, as even as they divide, the
        earlier stages taking the remainder (the last also computes the logits)."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))


#: one process, one device: no sharding, no collectives
SINGLE = ParallelContext()

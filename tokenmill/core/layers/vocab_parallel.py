"""Token embeddings split by vocabulary rows over tensor-parallel ranks.

Each rank keeps a contiguous range of rows (``vocab_range``); a token outside it embeds to
zeros there and the all-reduce sums in the one rank that has it. An LM head is a
``Linear`` with ``vocab_shard``: each rank computes its range's logits, and the runner
gathers them, or only each range's (max, index) where every row takes the argmax.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.core.layers.linear_shard import vocab_range
from tokenmill.interfaces.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.start, self.end = vocab_range(vocab_size, parallel)
        #: the rows' dtype on output: a platform may store the table narrower (bf16 values of an
        #: fp32 model, cpu/bf16_embeddings.py), widened exactly as rows are looked up
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)
        if parallel.tp_size > 1:
            self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: embedding of {self.vocab_size} x {tuple(param.shape[1:])}, "
                             f"checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight).to(self.dtype)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        x = nn.functional.embedding(local.masked_fill(~inside, 0), self.weight).to(self.dtype)
        return self.parallel.comm.all_reduce(x.masked_fill(~inside[:, None], 0))

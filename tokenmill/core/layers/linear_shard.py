"""Which slice of a checkpoint weight a tensor-parallel rank holds, with vLLM's semantics.

- column-parallel: each rank keeps ``1 / tp`` of every fused part's outputs (q/k/v,
  gate/up); no collective, the next row-parallel layer consumes the slice;
- QKV-parallel: column-parallel by heads, where ``tp > num_kv_heads`` gives each rank one
  KV head, replicated over the ``tp / num_kv_heads`` ranks that share it;
- row-parallel: each rank keeps ``1 / tp`` of the inputs and the partial outputs are
  summed with an all-reduce (the bias added once, after it);
- vocab: an embedding or LM head keeps a contiguous range of token rows.

A parameter says how its checkpoint tensor maps onto outputs and inputs
(``output_dim`` / ``input_dim``, and the units its packing or grouping makes of them:
GPTQ packs 8 inputs in an int32, its scales have a row per group); ``narrow`` cuts the
rank's slice from the checkpoint tensor before the parameter's own loader copies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.parallel import ParallelContext


@dataclass(frozen=True)
class LinearShard:
    parallel: ParallelContext
    #: "column": outputs are split (per fused part); "row": inputs are split
    kind: str
    #: per fused part: the checkpoint's size, this rank's size, and where its slice starts
    full_sizes: tuple[int, ...]
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    #: the inputs: the checkpoint's size, this rank's, and where its slice starts
    full_input: int
    input_size: int
    input_start: int

    @property
    def reduces(self) -> bool:
        """Whether the layer's output is a partial sum to all-reduce."""
        return self.kind == "row" and self.parallel.tp_size > 1

    def narrow(self, tensor: torch.Tensor, part: Optional[int], output_dim: Optional[int], input_dim: Optional[int],
               output_unit: int = 1, input_unit: int = 1, what: str = "") -> torch.Tensor:
        """This rank's slice of checkpoint ``tensor`` (part ``part`` of a fused layer, or all
        parts concatenated when None)."""
        if self.kind == "column" and output_dim is not None:
            if part is None:
                pieces = tensor.split([s // output_unit for s in self.full_sizes], dim=output_dim)
                tensor = torch.cat([self._cut(p, output_dim, start, size, output_unit, what)
                                    for p, start, size in zip(pieces, self.starts, self.sizes)], dim=output_dim)
            else:
                tensor = self._cut(tensor, output_dim, self.starts[part], self.sizes[part], output_unit, what)
        if self.kind == "row" and input_dim is not None:
            tensor = self._cut(tensor, input_dim, self.input_start, self.input_size, input_unit, what)
        return tensor

    def _cut(self, tensor: torch.Tensor, dim: int, start: int, size: int, unit: int, what: str) -> torch.Tensor:
        if start % unit or size % unit:
            raise ConfigError("tensor_parallel_size", f"{what}: a slice of {size} at {start} is not a whole number "
                                                      f"of its {unit}-wide packs or groups, so this layer cannot be "
                                                      f"split {self.parallel.tp_size} ways")
        return tensor.narrow(dim, start // unit, size // unit)

    def lora(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's ``A [r, in]`` and ``B [out, r]`` for this rank: B follows a column
        split, A a row split (its partial products are summed by the layer's all-reduce)."""
        if self.kind == "column" and b.dim() == 2 and b.shape[0] == self.full_sizes[part]:
            b = b.narrow(0, self.starts[part], self.sizes[part])
        if self.kind == "row" and a.dim() == 2 and a.shape[1] == self.full_input:
            a = a.narrow(1, self.input_start, self.input_size)
        return a, b


def _split(size: int, parallel: ParallelContext, what: str) -> tuple[int, int]:
    if size % parallel.tp_size:
        raise ConfigError("tensor_parallel_size", f"{what} has {size} channels, which "
                                                  f"tensor_parallel_size={parallel.tp_size} does not divide")
    local = size // parallel.tp_size
    return local, parallel.tp_rank * local


def column_shard(input_size: int, sizes: list[int], parallel: ParallelContext, what: str) -> LinearShard:
    split = [_split(s, parallel, what) for s in sizes]
    return LinearShard(parallel, "column", tuple(sizes), tuple(s for s, _ in split), tuple(o for _, o in split),
                       input_size, input_size, 0)


def qkv_shard(input_size: int, num_heads: int, num_kv_heads: int, head_dim: int, parallel: ParallelContext,
              what: str) -> tuple[LinearShard, int, int]:
    """The shard of a fused q/k/v layer, and this rank's (query heads, KV heads)."""
    tp, rank = parallel.tp_size, parallel.tp_rank
    if num_heads % tp:
        raise ConfigError("tensor_parallel_size", f"{what}: {num_heads} attention heads, which "
                                                  f"tensor_parallel_size={tp} does not divide")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ConfigError("tensor_parallel_size", f"{what}: {num_kv_heads} KV heads, which "
                                                      f"tensor_parallel_size={tp} does not divide")
        kv_local, kv_first = num_kv_heads // tp, rank * (num_kv_heads // tp)
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads read
        if tp % num_kv_heads:
            raise ConfigError("tensor_parallel_size", f"{what}: {num_kv_heads} KV heads cannot be replicated "
                                                      f"evenly over {tp} ranks")
        kv_local, kv_first = 1, rank * num_kv_heads // tp
    q_local = num_heads // tp
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    shard = LinearShard(parallel, "column", (q, kv, kv), (q_local * head_dim, kv_local * head_dim,
                                                          kv_local * head_dim),
                        (rank * q_local * head_dim, kv_first * head_dim, kv_first * head_dim),
                        input_size, input_size, 0)
    return shard, q_local, kv_local


def row_shard(input_size: int, output_size: int, parallel: ParallelContext, what: str) -> LinearShard:
    local, start = _split(input_size, parallel, what)
    return LinearShard(parallel, "row", (output_size,), (output_size,), (0,), input_size, local, start)


def vocab_range(vocab_size: int, parallel: ParallelContext) -> tuple[int, int]:
    """The token rows ``[start, end)`` this rank's embedding or LM head keeps: contiguous
    ranges of ``ceil(vocab / tp)``, the last one shorter."""
    per = -(-vocab_size // parallel.tp_size)
    start = min(vocab_size, parallel.tp_rank * per)
    return start, min(vocab_size, start + per)


def vocab_shard(input_size: int, vocab_size: int, parallel: ParallelContext) -> LinearShard:
    start, end = vocab_range(vocab_size, parallel)
    return LinearShard(parallel, "column", (vocab_size,), (end - start,), (start,), input_size, input_size, 0)

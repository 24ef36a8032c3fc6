"""Mixture-of-experts MLP: softmax top-k routing, experts computed grouped per expert."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.parallel import SINGLE, ParallelContext


class FusedMoE(nn.Module):
    """``E`` gated experts stored as ``w13 [E, 2 * inter, hidden]`` (gate rows, then up)
    and ``w2 [E, hidden, inter]``; each token goes to its top-k experts.

    Tokens are sorted by expert and each expert runs one matmul over all of its
    tokens: a Python loop over experts, never over tokens.

    Under tensor parallelism every rank holds every expert's slice of the intermediate
    dimension (gate/up split by rows, down by columns, vLLM's scheme), routes all tokens
    the same way, and the partial outputs are all-reduced.
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        if inter % parallel.tp_size:
            raise ConfigError("tensor_parallel_size", f"the experts' intermediate size {inter} is not divisible "
                                                      f"by tensor_parallel_size={parallel.tp_size}")
        self.parallel = parallel
        self.full_inter = inter
        inter //= parallel.tp_size
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        self.renormalize = renormalize
        self.act = activation
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        self.gate.weight.requires_grad_(False)

    def expert_weight(self, expert: int, part: str) -> torch.Tensor:
        """The view of ``w13``/``w2`` that holds one expert's checkpoint matrix ``part``
        ("gate", "up" or "down")."""
        if part == "gate":
            return self.w13.data[expert, : self.inter]
        if part == "up":
            return self.w13.data[expert, self.inter:]
        return self.w2.data[expert]

    def rank_slice(self, part: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor: one expert's ``part`` ("gate", "up",
        "down"), or all experts' fused "w13" ``[E, 2 * inter, hidden]`` / "w2" ``[E, hidden, inter]``."""
        if self.parallel.tp_size == 1:
            return tensor
        start = self.parallel.tp_rank * self.inter
        if part in ("gate", "up"):
            return tensor.narrow(0, start, self.inter)
        if part == "down":
            return tensor.narrow(1, start, self.inter)
        if part == "w13":
            gate, up = tensor.split(self.full_inter, dim=1)
            return torch.cat([gate.narrow(1, start, self.inter), up.narrow(1, start, self.inter)], dim=1)
        return tensor.narrow(2, start, self.inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [num_tokens, top_k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            tokens = token_of[rows]
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.w2[expert])
            out.index_add_(0, tokens, (y * flat_weights[rows, None]).to(out.dtype))
            start += count
        return self.parallel.comm.all_reduce(out) if self.parallel.tp_size > 1 else out

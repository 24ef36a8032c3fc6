"""Mixture-of-experts MLP: softmax top-k routing, experts computed grouped per expert."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F


class FusedMoE(nn.Module):
    """``E`` gated experts stored as ``w13 [E, 2 * inter, hidden]`` (gate rows, then up)
    and ``w2 [E, hidden, inter]``; each token goes to its top-k experts.

    Tokens are sorted by expert and each expert runs one matmul over all of its
    tokens: a Python loop over experts, never over tokens.
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
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
        return out

"""Mixture-of-experts MLP: softmax top-k routing, experts computed grouped per expert.

``FusedMoE`` is a ``CustomOp`` (op ``"fused_moe"``). Its ``forward_native`` counts each
expert's tokens on the host and runs one matmul per expert in a Python loop: the fastest
way on a CPU, where reading the counts costs nothing. On a GPU that read is a device-to-host
sync per layer, which stalls the stream and cannot be recorded in a CUDA graph; the device
path (``tokenmill.plugins.models.triton_moe.fused_moe``: routing and expert GEMMs on the
device, nothing read back) is what the cuda platform returns from ``Platform.custom_op``
for the op. The core does not import it (the core holds no device
code); tests run it on the CPU, under Triton's interpreter, by setting a layer's ``op_impl``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.parallel import SINGLE, ParallelContext


class FusedMoE(CustomOp):
    """``E`` gated experts stored as ``w13 [E, 2 * inter, hidden]`` (gate rows, then up)
    and ``w2 [E, hidden, inter]``; each token goes to its top-k experts.

    ``forward_native`` sorts tokens by expert and each expert runs one matmul over all of
    its tokens: a Python loop over experts, never over tokens.

    Under tensor parallelism every rank holds every expert's slice of the intermediate
    dimension (gate/up split by rows, down by columns, vLLM's scheme), routes all tokens
    the same way, and the partial outputs are all-reduced.
    """

    op_name = "fused_moe"
    native_in_graphs = False  # the loop reads each expert's token count back

    def __init__(self, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool, activation: str,
                 dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        if not isinstance(activation, str):
            raise TypeError("FusedMoE takes the activation's name (HF's hidden_act: 'silu', ...), not a function")
        if inter % parallel.tp_size:
            raise ConfigError("tensor_parallel_size", f"the experts' intermediate size {inter} is not divisible "
                                                      f"by tensor_parallel_size={parallel.tp_size}")
        self.parallel = parallel
        self.full_inter = inter
        inter //= parallel.tp_size
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        self.renormalize = renormalize
        #: ``act(gate) * up`` over a GEMM's ``[rows, 2 * inter]`` output (HF's ``hidden_act``): a
        #: CustomOp of its own, so a platform's fused kernel serves both paths
        self.act_and_mul = GatedActivation(activation)
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[num_tokens, top_k]`` and their weights: fp32 softmax
        probabilities, renormalised to sum to one where the model says so.

        Router logits tie often in bf16, and ``topk`` breaks ties as its kernel happens to
        (on a GPU, differently for different batch sizes: a decode step replayed from its
        graph's padded bucket would route otherwise than the same step run eagerly). A
        stable sort gives a tie to the lowest expert index, on every device and batch size."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.sort(dim=-1, descending=True, stable=True)
        weights, experts = weights[:, :self.top_k], experts[:, :self.top_k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial output (``out`` itself without tensor parallelism)."""
        return self.parallel.comm.all_reduce(out) if self.parallel.tp_size > 1 else out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, experts = self.route(x)
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
            y = F.linear(self.act_and_mul(F.linear(x[tokens], self.w13[expert])), self.w2[expert])
            out.index_add_(0, tokens, (y * flat_weights[rows, None]).to(out.dtype))
            start += count
        return self.all_reduce(out)

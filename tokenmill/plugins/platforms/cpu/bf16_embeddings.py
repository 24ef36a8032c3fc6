"""Token embeddings kept in bf16 where an fp32 model's are bf16 values.

On a CPU without bf16 arithmetic a bf16 checkpoint is computed in fp32 (``dtype: auto``), so
its embedding table is loaded widened: twice the checkpoint's bytes (the 350M benchmark
model: 125 MiB for 62.5). A lookup reads a few rows, whose widening back to fp32 is exact
and costs nothing next to a step, so the table is kept as the checkpoint stored it. Left
alone: a table the logits are computed from (tied embeddings: the output projection's GEMM
and the greedy head read it in fp32), and a model whose weights are updated in place (RL
weight transfer, sleep mode), whose new values need not be bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.core.layers.vocab_parallel import VocabParallelEmbedding


def narrow_bf16_embeddings(model: nn.Module) -> int:
    """Keep each untied fp32 embedding table whose values are all bf16 in bf16; returns how many."""
    # unknown models count as tied: their logits may read the table
    if getattr(model, "keeps_plain_weights", False) or getattr(model, "tie_word_embeddings", True):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.weight.dtype == torch.float32:
            narrow = module.weight.detach().to(torch.bfloat16)
            if torch.equal(narrow.float(), module.weight):
                module.weight = nn.Parameter(narrow, requires_grad=False)
                count += 1
    return count

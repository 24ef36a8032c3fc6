"""oneDNN's packed weights read in place, so that the GEMV needs no copy of its own.

``torch.ops.mkldnn._reorder_linear_weight`` returns an opaque tensor in the layout oneDNN's
GEMM wants, which PyTorch exposes only as a pointer and a byte count. On AVX-512 cores (this
project's Zen 4) that layout is blocks of 64 output rows, each holding all of K: for bf16 as
pairs of adjacent k for each of its rows, ``[N / 64, K / 2, 64, 2]`` (the pair layout
AVX512-BF16's dot product multiplies), for fp32 ``[N / 64, K, 64]``; one sequential stream
per block. Other cores (AMX, AVX2) or shapes may get another layout: ``packed_view``
recognises the layout by comparing the packed bytes with the plain weight rearranged into
each candidate, and returns None where none matches, so a layout it does not know keeps the
plain copy (and the GEMV that reads it) rather than a wrong answer.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

#: output rows per block that the GEMV (csrc/onednn_gemv.cpp) takes
BLOCK_ROWS = (64, 32, 16)


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the packed tensor's memory (no copy), which keeps ``packed`` alive
    (the memory is oneDNN's: the view's own storage does not own it)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    memory = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    memory.owner = packed
    return torch.frombuffer(memory, dtype=torch.uint8)


def packed_view(packed: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``packed`` (oneDNN's copy of ``weight`` [N, K]) as ``[N / NB, K / 2, NB, 2]`` (bf16) or
    ``[N / NB, K, NB]`` (fp32), or None where its bytes are not that layout for any NB in
    BLOCK_ROWS (padding included)."""
    if packed.layout != torch._mkldnn or weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
        return None
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16
    if (pairs and k % 2) or torch.ops.mkldnn._nbytes(packed) != weight.nbytes:
        return None
    memory = packed_bytes(packed).view(weight.dtype)
    for rows in BLOCK_ROWS:
        if n % rows:
            continue
        if pairs:
            view = memory.view(n // rows, k // 2, rows, 2)
            plain = weight.view(n // rows, rows, k // 2, 2).transpose(1, 2)
        else:
            view = memory.view(n // rows, k, rows)
            plain = weight.view(n // rows, rows, k).transpose(1, 2)
        if torch.equal(view, plain):
            return view
    return None

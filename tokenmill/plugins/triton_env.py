"""How the first-party Triton kernels run in this process: compiled for a GPU, or in Triton's
interpreter (``TRITON_INTERPRET=1``, read at import as Triton reads it: the CPU test suite's
setting), and which dot precision a compute dtype takes there."""

from __future__ import annotations

import os

import torch

#: kernels run in Triton's interpreter
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def ieee_fp32_dots(dtype: torch.dtype) -> bool:
    """fp32 (IEEE) dots for fp32 models; for bf16 ones too in the interpreter, whose dot of bf16
    tiles is wrong (numpy has no bf16), so that it checks the rest of the kernel. Elsewhere
    fp16/bf16 take the tensor cores with fp32 accumulation."""
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)

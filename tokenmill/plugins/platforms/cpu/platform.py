"""CpuPlatform: x86 and Arm CPUs through PyTorch, with tokenmill's C++ kernels.

What it decides:
- ``dtype: auto`` computes a bf16 checkpoint in fp32 where the CPU has no bf16 arithmetic
  (``native_bf16``): the same values, several times faster;
- the process's torch threads (``num_threads``) and glibc's malloc thresholds
  (``keep_freed_memory``);
- the optimisation pass: prepacked GEMM weights (a streaming GEMV copy kept for batch 1-2
  with ``small_batch_gemv``) and the fused norm, activation, rotary and decode-stack ops;
- weights moved to transparent huge pages (``huge_pages``);
- the int8-screened greedy head.
"""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.core.kernels import cpu_kernels
from tokenmill.core.layers.fused import enable_fused_ops
from tokenmill.core.layers.linear import prepack_linear_weights
from tokenmill.interfaces.platform import Detection, GreedyArgmax, Platform
from tokenmill.plugins.platforms.cpu.dtypes import native_bf16
from tokenmill.plugins.platforms.cpu.freed_memory import keep_freed_memory
from tokenmill.plugins.platforms.cpu.greedy_head import GreedyHead
from tokenmill.plugins.platforms.cpu.huge_pages import move_parameters_to_huge_pages


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0

    @classmethod
    def detect(cls) -> Detection:
        isa = "AVX512-BF16/AMX" if native_bf16() else "no bf16 arithmetic"
        return Detection(True, f"PyTorch's CPU backend ({isa}; {torch.get_num_threads()} threads available)")

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if checkpoint_dtype == torch.bfloat16 and not native_bf16():
            return torch.float32  # bf16 widens to fp32 exactly
        return checkpoint_dtype

    def setup_process(self) -> None:
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        if self.config.keep_freed_memory:  # before prepacking, whose temporaries then come from the heap
            keep_freed_memory()

    def optimize_model(self, model: torch.nn.Module) -> None:
        prepack_linear_weights(model, cpu_kernels(), gemv=self.config.small_batch_gemv, widen_bf16=not native_bf16())
        enable_fused_ops(model)

    def place_model(self, model: torch.nn.Module) -> None:
        if self.config.huge_pages:  # after prepacking: the plain weights it keeps are the ones streamed
            move_parameters_to_huge_pages(model)

    def greedy_head(self, model: torch.nn.Module) -> Optional[GreedyArgmax]:
        return GreedyHead.for_model(model, cpu_kernels())

    def describe(self) -> dict:
        return {**super().describe(), "native_bf16": native_bf16(), "threads": torch.get_num_threads()}

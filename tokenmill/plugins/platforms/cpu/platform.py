"""CpuPlatform: x86 and Arm CPUs through PyTorch, with tokenmill's C++ kernels.

What it decides (options in ``platform.cpu``, see options.py):
- ``dtype: auto`` computes a bf16 checkpoint in fp32 where the CPU has no bf16 arithmetic
  (``native_bf16``): the same values, several times faster;
- the process's torch threads (``num_threads``; by default all cores, split evenly among
  the ranks of an ``mp`` engine, which share this machine) and glibc's malloc thresholds
  (``keep_freed_memory``);
- the fused norm, activation and rotary ops (fused_ops.py);
- the optimisation pass: prepacked GEMM weights (a streaming GEMV copy kept for batch 1-2
  with ``small_batch_gemv``), bf16 values of an fp32 model kept in bf16 (bf16_embeddings.py
  and prepacked_linear.py) and the decode stack for plain Llama-style layers;
- weights moved to transparent huge pages (``huge_pages``);
- the int8-screened greedy head.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Optional

import torch

from tokenmill.core.layers.fused_decoder import FusableDecoder
from tokenmill.interfaces.platform import Detection, GreedyArgmax, Platform
from tokenmill.plugins.platforms.cpu.decode_stack import DecodeStack
from tokenmill.plugins.platforms.cpu.bf16_embeddings import narrow_bf16_embeddings
from tokenmill.plugins.platforms.cpu.dtypes import native_bf16
from tokenmill.plugins.platforms.cpu.freed_memory import keep_freed_memory
from tokenmill.plugins.platforms.cpu.fused_ops import FUSED_OPS
from tokenmill.plugins.platforms.cpu.greedy_head import GreedyHead
from tokenmill.plugins.platforms.cpu.huge_pages import collapse_in_place, move_parameters_to_huge_pages
from tokenmill.plugins.platforms.cpu.kernels import cpu_kernels
from tokenmill.plugins.platforms.cpu.options import CpuOptions
from tokenmill.plugins.platforms.cpu.prepacked_linear import (PrepackedLinearMethod, prepack_linear_weights,
                                                               repack_linear_weights)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    options_model = CpuOptions
    options: CpuOptions

    @classmethod
    def detect(cls) -> Detection:
        bf16 = "bf16 arithmetic" if native_bf16() else "no bf16 arithmetic"
        return Detection(True, f"PyTorch's CPU backend ({torch.backends.cpu.get_cpu_capability()}, {bf16}; "
                               f"{torch.get_num_threads()} threads available)")

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if checkpoint_dtype == torch.bfloat16 and not native_bf16():
            return torch.float32  # bf16 widens to fp32 exactly
        return checkpoint_dtype

    def setup_process(self, rank: int = 0) -> None:
        threads = self.options.num_threads
        ranks = self.config.parallel.world_size if self.config.parallel.executor == "mp" else 1
        if threads is None and ranks > 1 and "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores
            threads = max(1, len(os.sched_getaffinity(0)) // ranks)
        if threads is not None:
            torch.set_num_threads(threads)
        if self.options.keep_freed_memory:  # before prepacking, whose temporaries then come from the heap
            keep_freed_memory()

    def custom_op(self, layer: torch.nn.Module) -> Optional[Callable[..., Any]]:
        return FUSED_OPS.get(layer.op_name) if cpu_kernels() is not None else None

    def optimize_model(self, model: torch.nn.Module) -> None:
        prepack_linear_weights(model, cpu_kernels(), gemv=self.options.small_batch_gemv, widen_bf16=not native_bf16())
        narrow_bf16_embeddings(model)
        self._fuse_decoders(model)

    def release_memory(self) -> None:
        try:  # glibc keeps freed heap pages mapped until asked
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def refresh_weights(self, model: torch.nn.Module) -> None:
        repack_linear_weights(model)
        self._fuse_decoders(model)  # a stack built over the old weights' storage is dropped

    @staticmethod
    def _fuse_decoders(model: torch.nn.Module) -> None:
        kernels = cpu_kernels()
        if kernels is None or not hasattr(kernels, "DecodeStack"):
            return
        for module in model.modules():
            if isinstance(module, FusableDecoder):
                parts = module.decoder_layer_parts()
                # the stack runs the norms, rotary and activation fused: only where each of those
                # ops got its kernel (compilation_config.custom_ops may turn one off)
                if parts and all(getattr(op, "op_impl", None) is not None for layer in parts
                                 for op in (layer.input_norm, layer.rotary, layer.post_norm, layer.act)):
                    module.fused_decoder = DecodeStack(parts, kernels)

    def place_model(self, model: torch.nn.Module) -> None:
        if self.options.huge_pages:  # after prepacking: the weights the GEMV streams
            move_parameters_to_huge_pages(model)
            for module in model.modules():
                method = getattr(module, "method", None)
                if isinstance(method, PrepackedLinearMethod) and method.blocked is not None:
                    collapse_in_place(method.blocked.data_ptr(), method.blocked.nbytes)

    def greedy_head(self, model: torch.nn.Module) -> Optional[GreedyArgmax]:
        return GreedyHead.for_model(model, cpu_kernels())

    def describe(self) -> dict:
        kernels = cpu_kernels()
        # the threads the C++ kernels really use: a build without OpenMP would say 1 here
        kernel_threads = kernels.parallel_threads() if kernels is not None else None
        return {**super().describe(), "native_bf16": native_bf16(), "threads": torch.get_num_threads(),
                "kernel_threads": kernel_threads}

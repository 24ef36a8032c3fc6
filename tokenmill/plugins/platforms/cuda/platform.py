"""CudaPlatform: NVIDIA GPUs through PyTorch, attention in Triton.

What it decides (options in ``platform.cuda``):
- usable only where PyTorch has CUDA and a device is visible; ``tokenmill serve --platform
  cuda`` elsewhere fails at startup with the reason, never falling back to the CPU;
- ``dtype: auto`` computes fp32 checkpoints in fp16 (vLLM's rule), others as stored;
- weights on the device; the KV cache gets ``gpu_memory_utilization`` of the device's memory
  less what is in use once the weights are loaded and less the peak of a profiling forward
  pass's activations; swap space and input staging in pinned host memory, so copies to and
  from the device are asynchronous;
- decode steps recorded as CUDA graphs (``capture_graph``), all in one memory pool.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch

from tokenmill.interfaces.platform import Detection, DeviceGraph, Platform
from tokenmill.plugins.platforms.cuda.options import CudaOptions


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 10  # preferred to the CPU wherever it is usable
    options_model = CudaOptions
    options: CudaOptions
    profiles_memory = True
    #: the memory pool every captured graph allocates from (made with the first graph)
    _graph_pool = None

    @classmethod
    def detect(cls) -> Detection:
        if torch.version.cuda is None:
            return Detection(False, f"this PyTorch ({torch.__version__}) was built without CUDA; install a CUDA "
                                    "build of torch")
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return Detection(False, "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                                    if visible is not None else ""))
        return Detection(True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}")

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if checkpoint_dtype == torch.float32 else checkpoint_dtype

    def kv_cache_memory(self, requested: int, activation_bytes: int = 0) -> int:
        """What ``gpu_memory_utilization`` leaves once the weights are on the device and a
        forward pass's activations have their room (vLLM's rule)."""
        torch.cuda.empty_cache()  # the profiling pass's freed blocks are not in use
        free, total = torch.cuda.mem_get_info()
        return max(0, int(total * self.options.gpu_memory_utilization) - (total - free) - activation_bytes)

    def peak_memory(self, run: Callable[[], None]) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)

    def capture_graph(self, run: Callable[[], None]) -> Optional[DeviceGraph]:
        # the warm-up runs on a side stream, as CUDA graph capture requires (it also compiles
        # the Triton kernels and lets cuBLAS pick its algorithms before recording)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            run()
        return graph

    def place_model(self, model: torch.nn.Module) -> None:
        model.to(self.device_type)

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, pin_memory=True)

    def describe(self) -> dict:
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"platform": self.name, "device": self.device_type, "gpu": properties.name,
                "compute_capability": f"{properties.major}.{properties.minor}",
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "gpu_memory_utilization": self.options.gpu_memory_utilization}

"""CudaPlatform: NVIDIA GPUs through PyTorch, attention in Triton.

What it decides (options in ``platform.cuda``):
- usable only where PyTorch has CUDA and a device is visible; ``tokenmill serve --platform
  cuda`` elsewhere fails at startup with the reason, never falling back to the CPU;
- ``dtype: auto`` computes fp32 checkpoints in fp16 (vLLM's rule), others as stored;
- each rank on its own GPU; weights on the device; the KV cache gets ``gpu_memory_utilization``
  of the device's memory less what this engine uses once the weights are loaded and less the peak of a profiling forward
  pass's activations; swap space and input staging in pinned host memory, so copies to and
  from the device are asynchronous;
- decode steps recorded as CUDA graphs (``capture_graph``), all in one memory pool;
- the elementwise layers (RMSNorm, rotary embeddings, SiLU/GELU-and-mul) and mixture-of-experts
  layers on Triton kernels (``custom_op``: ``fused_ops``);
- a CUDA error that poisons the context stops the engine (``is_fatal_error``); running out
  of memory fails only that step's requests.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Callable, Optional, Sequence

import structlog
import torch

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.platform import Detection, DeviceEvent, DeviceGraph, Platform
from tokenmill.plugins.platforms.cuda.fused_ops import FUSED_OPS
from tokenmill.plugins.platforms.cuda.options import CudaOptions

log = structlog.get_logger(__name__)

#: the most this process is taken to hold outside torch's allocator beyond what it held at
#: ``setup_process`` (kernel modules loaded lazily, library handles): that share shows only in
#: the device-wide figure, where other processes' allocations and frees land too
OUTSIDE_TORCH_CEILING = 2**30


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
    #: the stream every graph's warm-up runs on (made with the first graph)
    _warmup_stream = None
    #: device memory in use when this engine started (``setup_process``): not this engine's
    _used_before = 0
    #: what torch's allocator held then (an engine this process still holds, say)
    _reserved_before = 0

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
        """vLLM's rule: a float32 checkpoint computes in the GPU's first half type, bfloat16
        from sm_80 on (its range is float32's), else float16; bfloat16 where the GPU has none
        computes in float16."""
        half = torch.bfloat16 if self.bf16_supported() else torch.float16
        return half if checkpoint_dtype in (torch.float32, torch.bfloat16) else checkpoint_dtype

    def bf16_supported(self) -> bool:
        return torch.cuda.get_device_capability() >= (8, 0)

    def setup_process(self, rank: int = 0) -> None:
        """The rank's GPU (one per rank, among those visible: a Ray actor sees only its own),
        and the memory in use before this engine loaded anything, so that its budget counts
        only its own use (vLLM's rule: two engines at 0.4 share a GPU)."""
        if self.options.cpu_offload_gb:
            raise ConfigError("platform.cuda.cpu_offload_gb", "offloading weights to host memory is not supported: "
                                                              "the weights must fit the GPU (or split them with "
                                                              "--tensor-parallel-size / --pipeline-parallel-size)")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        gc.collect()  # an engine this process dropped may still hold its caches through a cycle
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        wanted = total * self.options.gpu_memory_utilization
        if free < wanted:
            raise ConfigError("platform.cuda.gpu_memory_utilization",
                              f"{free / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} GiB are free, less than "
                              f"gpu_memory_utilization={self.options.gpu_memory_utilization} asks for "
                              f"({wanted / 2**30:.1f} GiB): lower it, or free the GPU")
        self._used_before = total - free
        self._reserved_before = torch.cuda.memory_reserved()

    def kv_cache_memory(self, requested: Optional[int], activation_bytes: int = 0) -> int:
        """What ``gpu_memory_utilization`` of the GPU leaves once this engine's weights are on
        it and a forward pass's activations have their room (vLLM's rule); a configured
        ``kv_cache_memory`` instead, where it fits beside them (it overrides the utilization,
        as vLLM's ``kv_cache_memory_bytes`` does)."""
        torch.cuda.empty_cache()  # the profiling pass's freed blocks are not in use
        free, total = torch.cuda.mem_get_info()
        if requested is not None:
            room = free - activation_bytes
            if requested > room:
                raise ConfigError("cache.kv_cache_memory",
                                  f"{requested / 2**30:.2f} GiB asked for the KV cache, {room / 2**30:.2f} GiB of "
                                  "the GPU free beside the weights and a forward pass's activations")
            return requested
        return max(0, int(total * self.options.gpu_memory_utilization) - self._own_use(free, total) - activation_bytes)

    def _own_use(self, free: int, total: int) -> int:
        """What this engine took since ``setup_process``: torch's allocator's growth (weights,
        workspaces), which is this process's alone, plus what it took outside torch, read
        device-wide and so clamped to [0, OUTSIDE_TORCH_CEILING]. Another process starting or
        stopping beside this one (four test workers, two engines at 0.4) moves the device-wide
        figure by gigabytes: counted, it would size the cache to nothing, or past its share."""
        in_torch = torch.cuda.memory_reserved() - self._reserved_before
        outside = (total - free) - self._used_before - in_torch
        if not 0 <= outside <= OUTSIDE_TORCH_CEILING:
            log.warning("the GPU's memory in use changed by more than this engine's own allocations while it started: "
                        "another process is using the GPU", outside_torch_mib=round(outside / 2**20))
        return in_torch + min(max(outside, 0), OUTSIDE_TORCH_CEILING)

    def peak_memory(self, run: Callable[[], None]) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)

    def capture_graph(self, run: Callable[[], None]) -> Optional[DeviceGraph]:
        # the warm-up runs on a side stream, as CUDA graph capture requires (it also compiles
        # the Triton kernels and lets cuBLAS pick its algorithms before recording); one for
        # every bucket, since cuBLAS keeps a workspace (32 MiB on Hopper) per stream it saw,
        # for the life of the process, outside the memory the KV cache was sized against
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream()
        side = self._warmup_stream
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

    def is_fatal_error(self, error: BaseException) -> bool:
        """torch's ``AcceleratorError``, and the CUDA errors that reach Python as plain
        ``RuntimeError`` (Triton's launcher, older code paths): an illegal address or a
        device-side assert leaves the context unusable."""
        if isinstance(error, torch.OutOfMemoryError):
            return False
        text = str(error)
        return super().is_fatal_error(error) or (isinstance(error, RuntimeError) and any(
            marker in text for marker in ("CUDA error", "Triton Error [CUDA]", "illegal memory access",
                                          "device-side assert", "cudaError")))

    def custom_op(self, layer: torch.nn.Module) -> Optional[Callable[..., Any]]:
        """One Triton kernel per elementwise layer, where eager runs several; mixture-of-experts
        layers route on the device (Triton grouped GEMMs over tokens sorted by expert): no host
        synchronisation per layer, so their decode steps record as graphs."""
        return FUSED_OPS.get(layer.op_name)

    def place_model(self, model: torch.nn.Module) -> None:
        model.to(self.device_type)

    def release_memory(self) -> None:
        torch.cuda.empty_cache()  # the caching allocator keeps freed blocks from other users
        if torch.cuda.is_initialized():  # its host allocator keeps freed pinned blocks (sleep's copies) page-locked
            (getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache)()

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, pin_memory=True)

    def noise_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(seed)

    def record_event(self) -> DeviceEvent:
        event = torch.cuda.Event()
        event.record()
        return event

    def describe(self) -> dict:
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"platform": self.name, "device": self.device_type, "gpu": properties.name,
                "compute_capability": f"{properties.major}.{properties.minor}",
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "gpu_memory_utilization": self.options.gpu_memory_utilization}

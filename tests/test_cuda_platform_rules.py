"""The cuda platform's configuration rules, checked on the CPU (no device call is reached):
what ``dtype: auto`` computes a checkpoint in, and how the KV cache's budget is set."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.config.model_config import load_model_config
from tokenmill.interfaces.errors import ConfigError
from tokenmill.plugins.platforms.cuda.options import CudaOptions
from tokenmill.plugins.platforms.cuda.platform import OUTSIDE_TORCH_CEILING, CudaPlatform

GiB = 2**30


def cuda(bf16: bool, **options) -> CudaPlatform:
    platform = CudaPlatform(None, CudaOptions(**options))
    platform.bf16_supported = lambda: bf16  # sm_80 and later, or not
    return platform


@pytest.mark.parametrize("bf16, arch, computed", [
    (True, "llama", torch.bfloat16), (True, "gemma2", torch.bfloat16),
    (False, "llama", torch.float16), (False, "gemma2", torch.float32),
])
def test_float32_checkpoints_compute_in_the_gpus_half_type_and_gemma2_never_in_float16(bf16, arch, computed,
                                                                                      model_dir):
    """vLLM's rule: bfloat16 where the GPU has it (float32's range), else float16, except for
    the models whose activations pass float16's range (Gemma-2 ships float32 weights: in
    float16 it overflows to inf and NaN), which then stay in float32."""
    config = load_model_config(model_dir(arch), "auto", resolve_dtype=cuda(bf16).resolve_dtype)
    assert config.dtype == computed


def test_float16_is_refused_for_models_it_overflows(model_dir):
    with pytest.raises(ConfigError, match="float16"):
        load_model_config(model_dir("gemma2"), "float16")
    assert load_model_config(model_dir("llama"), "float16").dtype == torch.float16


class FakeDevice:
    """torch.cuda's memory figures for an 80 GiB GPU: ``in_use`` device-wide (every process),
    ``reserved`` by this process's torch allocator."""

    def __init__(self, monkeypatch, in_use: int, reserved: int = 0):
        self.in_use, self.reserved = in_use, reserved
        for name, fake in {"empty_cache": lambda: None, "set_device": lambda _: None, "device_count": lambda: 1,
                           "mem_get_info": lambda: (80 * GiB - self.in_use, 80 * GiB),
                           "memory_reserved": lambda: self.reserved}.items():
            monkeypatch.setattr(torch.cuda, name, fake)

    def allocate(self, size: int, by_torch: bool = True) -> None:
        self.in_use += size
        self.reserved += size if by_torch else 0


def test_a_configured_kv_cache_budget_overrides_the_memory_utilization(monkeypatch):
    """Unset, the KV cache takes what ``gpu_memory_utilization`` leaves beside this engine's
    weights and activations; set (``--kv-cache-memory-bytes``), exactly that, where it fits."""
    device = FakeDevice(monkeypatch, in_use=GiB)  # the CUDA context, before the engine
    platform = cuda(True, gpu_memory_utilization=0.9)
    platform.setup_process()
    device.allocate(19 * GiB)  # the weights
    device.allocate(GiB // 2, by_torch=False)  # kernel modules
    assert platform.kv_cache_memory(None, activation_bytes=2 * GiB) == int(72 * GiB) - 19.5 * GiB - 2 * GiB
    assert platform.kv_cache_memory(GiB, activation_bytes=2 * GiB) == GiB
    with pytest.raises(ConfigError, match="cache.kv_cache_memory"):
        platform.kv_cache_memory(59 * GiB, activation_bytes=2 * GiB)


@pytest.mark.parametrize("others, unseen", [(-30 * GiB, 0), (40 * GiB, OUTSIDE_TORCH_CEILING)],
                         ids=["another-process-frees", "another-process-allocates"])
def test_another_process_on_the_gpu_moves_no_engines_kv_budget(monkeypatch, others, unseen):
    """Measured on an H200 with four test workers starting engines at 0.1 side by side: read
    device-wide, the others' allocations left one engine 1.3 of its 14 GiB (341k blocks where
    3.7 million fit) and another none; their frees would size a cache past its share. The
    budget counts this process's allocations, and
    of the device-wide growth outside torch's allocator (which may be this process's) at most
    OUTSIDE_TORCH_CEILING."""
    device = FakeDevice(monkeypatch, in_use=50 * GiB, reserved=3 * GiB)  # others' 47 GiB, and an engine of ours
    platform = cuda(True, gpu_memory_utilization=0.25)
    platform.setup_process()
    device.allocate(5 * GiB)  # the weights
    device.in_use += others
    assert platform.kv_cache_memory(None, activation_bytes=GiB) == int(20 * GiB) - 5 * GiB - GiB - unseen

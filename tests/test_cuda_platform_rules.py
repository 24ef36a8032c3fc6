"""The cuda platform's configuration rules, checked on the CPU (no device call is reached):
what ``dtype: auto`` computes a checkpoint in, and how the KV cache's budget is set."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.config.model_config import load_model_config
from tokenmill.interfaces.errors import ConfigError
from tokenmill.plugins.platforms.cuda.options import CudaOptions
from tokenmill.plugins.platforms.cuda.platform import CudaPlatform

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


def test_a_configured_kv_cache_budget_overrides_the_memory_utilization(monkeypatch):
    """Unset, the KV cache takes what ``gpu_memory_utilization`` leaves beside this engine's
    weights and activations; set (``--kv-cache-memory-bytes``), exactly that, where it fits."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * GiB, 80 * GiB))  # 20 GiB in use: the weights
    platform = cuda(True, gpu_memory_utilization=0.9)
    assert platform.kv_cache_memory(None, activation_bytes=2 * GiB) == int(72 * GiB) - 20 * GiB - 2 * GiB
    assert platform.kv_cache_memory(GiB, activation_bytes=2 * GiB) == GiB
    with pytest.raises(ConfigError, match="cache.kv_cache_memory"):
        platform.kv_cache_memory(59 * GiB, activation_bytes=2 * GiB)

"""Building one rank's model: the part of an engine every rank of a multi-process model repeats.

The driver and each worker call ``build_model`` with the same config and their own
``ParallelContext``: the checkpoint streams into this rank's shard (its columns, rows,
vocabulary range, pipeline stage), the platform optimises it, and the adapters attach.
How many KV blocks it can hold is each rank's to say (after a profiling forward pass, on a
platform that ``profiles_memory``); the engine allocates the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import structlog
import torch

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import ModelConfig, load_model_config
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.custom_op import CustomOp, dispatch_custom_ops
from tokenmill.core.model_loader.safetensors_files import iterate_weights
from tokenmill.core.model_loader.weights import load_strictly
from tokenmill.core.plugin_host.components import Components
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.core.worker.kv_cache import SwapCaches, allocate_kv_caches
from tokenmill.core.worker.memory_profile import profile_forward, profile_sampling
from tokenmill.interfaces.adapters import AdapterType
from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.models import ModelContext
from tokenmill.interfaces.parallel import ParallelContext
from tokenmill.interfaces.platform import Platform

log = structlog.get_logger("tokenmill.builder")


@dataclass
class BuiltModel:
    """One rank's model and what was decided with it."""

    model_config: ModelConfig
    model_class: type
    model: torch.nn.Module
    backend: AttentionBackend
    adapters: Optional[AdapterType]
    cache_dtype: torch.dtype
    parallel: ParallelContext

    @property
    def is_embedding_model(self) -> bool:
        return bool(getattr(self.model_class, "is_embedding_model", False))

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes one block takes over this rank's attention layers (its heads, its stage)."""
        total = 0
        for module in self.model.modules():
            if isinstance(module, Attention):
                elements = 1
                for dim in self.backend.kv_cache_shape(1, block_size, module.spec.num_kv_heads, module.spec.head_dim):
                    elements *= dim
                total += elements * self.cache_dtype.itemsize
        return total

    def kv_capacity(self, config: EngineConfig, platform: Platform, extra_bytes_per_block: int = 0
                    ) -> tuple[int, int]:
        """(KV blocks this rank's budget holds, host blocks its swap space holds).
        ``extra_bytes_per_block``: other caches over the same blocks (a draft model's)."""
        per_block = max(1, self.kv_bytes_per_block(config.cache.block_size) + extra_bytes_per_block)
        activations = 0
        if platform.profiles_memory:
            drafts = (config.speculative.num_speculative_tokens or 0) if config.speculative.method else 0
            # draft tokens count against the step's token budget: no step samples more rows
            sampled_rows = min(config.scheduler.max_num_seqs * (1 + drafts), config.scheduler.max_num_batched_tokens)

            def largest_step() -> None:
                profile_forward(self.model, self.backend, self.parallel, self.model_config.vocab_size,
                                self.cache_dtype, platform, config.scheduler.max_num_batched_tokens,
                                config.scheduler.max_num_seqs, self.model_config.max_model_len,
                                config.cache.block_size)
                profile_sampling(self.model_config.vocab_size, sampled_rows, config.server.max_logprobs, platform)

            activations = platform.peak_memory(largest_step)
            log.info("memory profiled", activation_mib=round(activations / 2**20, 1),
                     tokens=config.scheduler.max_num_batched_tokens, sampled_rows=sampled_rows)
        budget = platform.kv_cache_memory(config.cache.kv_cache_memory, activations)
        return budget // per_block, int(config.cache.swap_space) // per_block

    def allocate_caches(self, config: EngineConfig, platform: Platform, num_blocks: int,
                        num_host_blocks: int) -> Optional[SwapCaches]:
        """Bind each attention layer's KV cache; the host swap twins when preemption swaps."""
        layers = allocate_kv_caches(self.model, self.backend, num_blocks, config.cache.block_size, self.cache_dtype,
                                    platform.device_type)
        if config.scheduler.preemption_mode != "swap":
            return None
        return SwapCaches.allocate(self.backend, layers, num_host_blocks, config.cache.block_size, self.cache_dtype,
                                   platform.host_buffer)


def build_model(config: EngineConfig, components: Components, pm: PluginManager, platform: Platform,
                parallel: ParallelContext) -> BuiltModel:
    model_config = load_model_config(config.model, config.dtype, config.max_model_len, platform.resolve_dtype,
                                     config.generation_config, config.override_generation_config, config.hf_overrides)
    model_cls = components.model_architectures.get(model_config.architecture)
    _check_parallel(model_cls, model_config, parallel)
    backend = _attention_backend(config, model_config, components, pm, platform)
    quantization = _quantization(config, model_config, components)
    torch.manual_seed(config.seed)
    with torch.device(platform.device_type):  # parameters made on the device, loaded straight into it
        model = model_cls(ModelContext(model_config.hf_config, model_config.dtype, backend, quantization, parallel))
    _load_checkpoint(model, model_config)
    # a trainer's updates and sleep's reload write into the plain weights: the platform keeps them
    model.keeps_plain_weights = config.weight_transfer_config is not None or config.enable_sleep_mode
    dispatch_custom_ops(model, platform, config.compilation_config.op_enabled)
    _check_op_names(model, config.compilation_config.named_ops())
    if config.compilation_config.platform_kernels:
        platform.optimize_model(model)
    platform.place_model(model)
    platform.release_memory()  # before the KV cache: the checkpoint's tensors, plain weights packed since
    _log_weight_memory(model, model_config, parallel)
    model.eval()
    adapters = None
    if config.adapters.enable_lora and not getattr(model_cls, "is_embedding_model", False):
        adapters = components.adapter_types.get("lora")(config.adapters)
        adapters.host_buffer = platform.host_buffer
        adapters.attach(model)
        for name, path in config.adapters.lora_modules.items():
            adapters.load(name, path)
    return BuiltModel(model_config, model_cls, model, backend, adapters, _kv_cache_dtype(config, model_config),
                      parallel)


def _check_parallel(model_cls: type, model_config: ModelConfig, parallel: ParallelContext) -> None:
    if parallel.world_size > 1 and getattr(model_cls, "is_classifier", False):
        raise ConfigError("tensor_parallel_size", f"{model_config.architecture} is a classifier, which runs in one "
                                                  "process: set tensor_parallel_size and pipeline_parallel_size to 1")
    if parallel.world_size > 1 and getattr(model_cls, "is_embedding_model", False):
        raise ConfigError("tensor_parallel_size", f"{model_config.architecture} is an embedding model, which runs "
                                                  "in one process: set tensor_parallel_size and "
                                                  "pipeline_parallel_size to 1")
    if parallel.pp_size > 1 and not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ConfigError("pipeline_parallel_size", f"{model_config.architecture} does not split into pipeline "
                                                    "stages (its class lacks supports_pipeline_parallel)")
    if parallel.pp_size > model_config.num_layers:
        raise ConfigError("pipeline_parallel_size", f"{parallel.pp_size} stages for {model_config.num_layers} "
                                                    "layers: every stage needs at least one")


def _attention_backend(
    config: EngineConfig, model_config: ModelConfig, components: Components, pm: PluginManager, platform: Platform
) -> AttentionBackend:
    name = config.attention.backend
    if name == "auto":
        name = pm.hook.select_attention_backend(device=platform.device_type, model_config=model_config)
        if name is None:
            raise ConfigError("attention.backend", "'auto' found no backend; available: "
                              + ", ".join(components.attention_backends.names()))
    backend = components.attention_backends.get(name)()
    caps = backend.capabilities
    problems = []
    if model_config.dtype not in caps.dtypes:
        problems.append(f"dtype {model_config.dtype} not in {caps.dtypes}")
    cache_dtype = _kv_cache_dtype(config, model_config)
    if cache_dtype != model_config.dtype and cache_dtype not in caps.kv_cache_dtypes:
        problems.append(f"cache.kv_cache_dtype {config.cache.kv_cache_dtype}: it keeps K/V in the compute "
                        f"dtype ({model_config.dtype}) only")
    if caps.head_sizes is not None and model_config.head_dim not in caps.head_sizes:
        problems.append(f"head size {model_config.head_dim} not in {caps.head_sizes}")
    if caps.block_sizes is not None and config.cache.block_size not in caps.block_sizes:
        problems.append(f"block size {config.cache.block_size} not in {caps.block_sizes}")
    if model_config.sliding_window is not None and not caps.sliding_window:
        problems.append("the model uses sliding-window attention, which it does not support")
    if model_config.hf_config.get("attn_logit_softcapping") is not None and not caps.logits_soft_cap:
        problems.append("the model soft-caps attention logits, which it does not support")
    if caps.requires_device is not None and caps.requires_device != platform.device_type:
        problems.append(f"it needs a {caps.requires_device} device (this engine runs on {platform.device_type}; "
                        "TRITON_INTERPRET=1 runs Triton kernels in the interpreter, for tests)")
    if problems:
        raise ConfigError("attention.backend", f"backend {name!r} cannot run this model: " + "; ".join(problems))
    return backend


def _check_op_names(model: torch.nn.Module, named: set[str]) -> None:
    """A "+op"/"-op" naming no op of this model does nothing: say so (vLLM's names and this
    model's may differ: Gemma's activation is gelu_pytorch_tanh_and_mul here)."""
    ops = {module.op_name for module in model.modules() if isinstance(module, CustomOp)}
    if named - ops:
        log.warning("compilation_config.custom_ops names ops this model does not have",
                    unknown=sorted(named - ops), model_ops=sorted(ops))


def _quantization(config: EngineConfig, model_config: ModelConfig, components: Components):
    quant_config = model_config.quantization_config or {}
    method = config.quantization.method or quant_config.get("quant_method")
    if method is None:
        return None
    return components.quantization_methods.get(method)(quant_config, config.quantization)


def _load_checkpoint(model: torch.nn.Module, model_config: ModelConfig) -> None:
    load_strictly(model, iterate_weights(model_config.path), str(model_config.path))
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def _log_weight_memory(model: torch.nn.Module, model_config: ModelConfig, parallel: ParallelContext) -> None:
    """After the fast paths, so a packed copy kept beside a plain weight is counted."""
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    extra: dict[str, Any] = {"rank": parallel.rank} if parallel.world_size > 1 else {}
    log.info("weights loaded", weight_memory_mib=round(weight_bytes / 2**20, 2),
             quantization=(model_config.quantization_config or {}).get("quant_method"), **extra)


def _kv_cache_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """What K/V are stored in: "auto" follows the compute dtype (vLLM's rule)."""
    name = config.cache.kv_cache_dtype
    return model_config.dtype if name == "auto" else getattr(torch, name)

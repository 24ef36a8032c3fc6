"""Building an engine from its config: the one place where hooks are called.

Plugins register components into registries once; the config's names are
resolved to instances here, validated together (backend capabilities vs the
model, KV pool vs context length), and the result is plain objects that call
each other directly on the hot path.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import structlog
import torch
from transformers import AutoTokenizer

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import ModelConfig, load_model_config
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.layers.custom_op import dispatch_custom_ops
from tokenmill.core.layers.pooler import Pooler
from tokenmill.core.model_loader.safetensors_files import iterate_weights
from tokenmill.core.model_loader.weights import load_strictly
from tokenmill.core.plugin_host.components import Components, collect_components
from tokenmill.core.plugin_host.registry import import_class_path
from tokenmill.core.sample.logits_processors import BUILTIN_LOGITS_PROCESSORS
from tokenmill.core.sample.logits_processors.structured_output import StructuredOutput
from tokenmill.core.structured_output.manager import StructuredOutputManager
from tokenmill.core.plugin_host.platform_selection import select_platform
from tokenmill.core.plugin_host.plugin_manager import PluginManager, make_plugin_manager
from tokenmill.core.sched.kv_cache_manager import KVCacheManager
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.sched.swap_space import SwapSpace
from tokenmill.core.worker.kv_cache import SwapCaches, allocate_kv_caches
from tokenmill.core.worker.model_runner import ModelRunner
from tokenmill.interfaces.attention import AttentionBackend
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.logits_processor import LogitsProcessor, LogitsProcessorContext
from tokenmill.interfaces.structured_output import StructuredOutputBackend, StructuredOutputContext
from tokenmill.interfaces.models import ModelContext
from tokenmill.interfaces.platform import Platform

log = structlog.get_logger("tokenmill.builder")

#: what structured_outputs.backend "auto" tries, in order (vLLM's default is xgrammar too),
#: with the library each needs
_AUTO_BACKENDS = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def build_engine(config: EngineConfig, pm: Optional[PluginManager] = None) -> LLMEngine | EmbeddingEngine:
    """A generation engine, or an embedding engine when the architecture is an encoder."""
    if config.model is None:
        raise ConfigError("model", "no model given: pass a model directory or set 'model' in the YAML")
    pm = pm or make_plugin_manager()
    components = collect_components(pm)
    platform = select_platform(components.platforms, config)
    platform.setup_process()
    model_config = load_model_config(config.model, config.dtype, config.max_model_len, platform.resolve_dtype)
    _check_scheduler_limits(config, model_config)

    backend = _attention_backend(config, model_config, components, pm, platform)
    policy = components.scheduling_policies.get(config.scheduler.policy)(config.scheduler)
    quantization = _quantization(config, model_config, components)

    model_cls = components.model_architectures.get(model_config.architecture)
    torch.manual_seed(config.seed)
    model = model_cls(ModelContext(model_config.hf_config, model_config.dtype, backend, quantization))
    _load_checkpoint(model, model_config)
    if not config.enforce_eager:
        dispatch_custom_ops(model, platform)
        platform.optimize_model(model)
    platform.place_model(model)
    _log_weight_memory(model, model_config)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(
        config.tokenizer or config.model, trust_remote_code=config.trust_remote_code
    )
    if getattr(model_cls, "is_embedding_model", False):
        engine = EmbeddingEngine(config, model_config, tokenizer, model, Pooler.from_model_dir(model_config.path),
                                 pm, config.scheduler.max_num_batched_tokens)
        log.info("embedding engine built", model=str(model_config.path), architecture=model_config.architecture,
                 pooling=engine.pooler.mode, normalize=engine.pooler.normalize)
        pm.hook.engine_started(engine=engine)
        return engine

    adapters = None
    if config.adapters.enable_lora:
        adapters = components.adapter_types.get("lora")(config.adapters)
        adapters.attach(model)
        for name, path in config.adapters.lora_modules.items():
            adapters.load(name, path)

    cache_dtype = _kv_cache_dtype(config, model_config)
    num_blocks, bytes_per_block = _num_kv_blocks(config, model_config, backend, cache_dtype, platform)
    layers = allocate_kv_caches(model, backend, num_blocks, config.cache.block_size, cache_dtype,
                                platform.device_type)
    kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.prefix_caching)
    swap_space, swap_caches = None, None
    if config.scheduler.preemption_mode == "swap":
        num_host_blocks = int(config.cache.swap_space) // bytes_per_block
        swap_space = SwapSpace(num_host_blocks)
        swap_caches = SwapCaches.allocate(backend, layers, num_host_blocks, config.cache.block_size, cache_dtype,
                                          platform.host_buffer)
    scheduler = Scheduler(config.scheduler, kv_cache, policy, swap_space,
                          max_adapters=adapters.max_active if adapters else None)
    greedy_head = None if config.enforce_eager or adapters else platform.greedy_head(model)
    context = LogitsProcessorContext(
        vocab_size=model_config.vocab_size, eos_token_ids=model_config.eos_token_ids,
        max_num_seqs=config.scheduler.max_num_seqs, device=torch.device(platform.device_type), tokenizer=tokenizer)
    structured = _structured_outputs(config, components, context)
    processors = ((StructuredOutput(context, structured),) if structured else ()) + _logits_processors(
        config, components, context)
    runner = ModelRunner(model, backend, config.cache.block_size, config.seed, swap_caches, adapters, greedy_head,
                         processors)
    engine = LLMEngine(config, model_config, tokenizer, scheduler, runner, pm, adapters, platform, structured)
    log.info("engine built", **platform.describe(), model=str(model_config.path),
             architecture=model_config.architecture,
             dtype=str(model_config.dtype).removeprefix("torch."), attention=backend.name,
             kv_cache_dtype=str(cache_dtype).removeprefix("torch."),
             policy=config.scheduler.policy, kv_blocks=num_blocks,
             max_model_len=model_config.max_model_len)
    pm.hook.engine_started(engine=engine)
    return engine


def _logits_processors(config: EngineConfig, components: Components,
                       context: LogitsProcessorContext) -> tuple[LogitsProcessor, ...]:
    """The built-ins, then the configured ones: registered names or ``module:Class`` paths."""
    classes: list[type[LogitsProcessor]] = list(BUILTIN_LOGITS_PROCESSORS)
    for name in config.logits_processors:
        if name in components.logits_processors:
            cls = components.logits_processors.get(name)
        else:
            cls = import_class_path(name, "logits_processors", components.logits_processors.names())
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError("logits_processors", f"{name!r} is not a LogitsProcessor subclass "
                              "(tokenmill.interfaces.logits_processor)")
        classes.append(cls)
    return tuple(cls(context) for cls in classes)


def _structured_outputs(config: EngineConfig, components: Components,
                        context: LogitsProcessorContext) -> Optional[StructuredOutputManager]:
    """The engine's structured output backend: the configured one (resolved now, so a name
    or library that is missing fails at startup), or for "auto" the first first-party one
    whose library is installed, imported only when the first constraint arrives: most
    engines never see one, and importing xgrammar loads a compiler runtime."""
    name = config.structured_outputs.backend
    if name == "auto":
        name = next((n for n, library in _AUTO_BACKENDS.items()
                     if n in components.structured_output_backends and importlib.util.find_spec(library)), None)
        if name is None:
            log.info("no structured output backend installed: constrained requests will be refused")
            return None
    else:
        _backend_class(components, name)
    backend_context = StructuredOutputContext(context.tokenizer, context.vocab_size, context.eos_token_ids)
    return StructuredOutputManager(name, lambda: _backend_class(components, name)(backend_context))


def _backend_class(components: Components, name: str) -> type[StructuredOutputBackend]:
    cls = components.structured_output_backends.get(name)
    if not (isinstance(cls, type) and issubclass(cls, StructuredOutputBackend)):
        raise ConfigError("structured_outputs.backend", f"{name!r} is not a StructuredOutputBackend "
                                                        "(tokenmill.interfaces.structured_output)")
    return cls


def _check_scheduler_limits(config: EngineConfig, model_config: ModelConfig) -> None:
    if not config.scheduler.chunked_prefill and config.scheduler.max_num_batched_tokens < model_config.max_model_len:
        raise ConfigError(
            "scheduler.max_num_batched_tokens",
            f"{config.scheduler.max_num_batched_tokens} is below max_model_len "
            f"({model_config.max_model_len}); without chunked prefill a long prompt could never "
            "be scheduled. Raise it, lower max_model_len, or enable chunked prefill",
        )


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


def _log_weight_memory(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """After the fast paths, so a packed copy kept beside a plain weight is counted."""
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    log.info("weights loaded", weight_memory_mib=round(weight_bytes / 2**20, 2),
             quantization=(model_config.quantization_config or {}).get("quant_method"))


def _kv_cache_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    """What K/V are stored in: "auto" follows the compute dtype (vLLM's rule)."""
    name = config.cache.kv_cache_dtype
    return model_config.dtype if name == "auto" else getattr(torch, name)


def _num_kv_blocks(config: EngineConfig, model_config: ModelConfig, backend: AttentionBackend,
                   cache_dtype: torch.dtype, platform: Platform) -> tuple[int, int]:
    """(number of KV blocks, bytes per block across all layers)."""
    block_size = config.cache.block_size
    per_layer = 1
    for dim in backend.kv_cache_shape(1, block_size, model_config.num_kv_heads, model_config.head_dim):
        per_layer *= dim
    bytes_per_block = per_layer * model_config.num_layers * cache_dtype.itemsize
    blocks_per_seq = -(-model_config.max_model_len // block_size)
    if config.cache.num_blocks is not None:
        num_blocks, source = config.cache.num_blocks, "cache.num_blocks"
    else:
        num_blocks = min(platform.kv_cache_memory(int(config.cache.kv_cache_memory)) // bytes_per_block,
                         blocks_per_seq * config.scheduler.max_num_seqs)
        source = "cache.kv_cache_memory"
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            source,
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than one "
            f"sequence of max_model_len={model_config.max_model_len} needs ({blocks_per_seq}); "
            "give it more memory or lower max_model_len",
        )
    return num_blocks, bytes_per_block

"""Building an engine from its config: the one place where hooks are called.

Plugins register components into registries once; the config's names are
resolved to instances here, validated together (backend capabilities vs the
model, KV pool vs context length), and the result is plain objects that call
each other directly on the hot path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import structlog
import torch
from transformers import AutoTokenizer

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import ModelConfig
from tokenmill.core.distributed.communicator import Communicator
from tokenmill.core.distributed.driver import DistributedAdapters, DistributedModelStep, WorkerGroup
from tokenmill.core.distributed.messages import Setup
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.gc_heap import freeze_import_heap
from tokenmill.core.engine.control_plane import ControlPlane
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.rollout import EngineControl
from tokenmill.core.layers.pooler import Pooler
from tokenmill.core.plugin_host.components import Components, collect_components
from tokenmill.core.plugin_host.platform_selection import select_platform
from tokenmill.core.plugin_host.plugin_manager import PluginManager, make_plugin_manager
from tokenmill.core.plugin_host.registry import import_class_path
from tokenmill.core.sample.logits_processors import BUILTIN_LOGITS_PROCESSORS
from tokenmill.core.sample.logits_processors.structured_output import StructuredOutput
from tokenmill.core.sched.kv_cache_manager import KVCacheManager
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.sched.swap_space import SwapSpace
from tokenmill.core.spec_decode.proposer_model import LocalProposerModel, load_proposer_model
from tokenmill.core.spec_decode.speculator import Speculator
from tokenmill.core.structured_output.manager import StructuredOutputManager
from tokenmill.core.worker.decode_graphs import DecodeGraphs
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.model_builder import build_model
from tokenmill.core.worker.model_runner import ModelRunner
from tokenmill.core.worker.model_step import ModelStep
from tokenmill.core.worker.worker_control import RankParts, WorkerControl
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.logits_processor import LogitsProcessor, LogitsProcessorContext
from tokenmill.interfaces.parallel import SINGLE, ParallelContext
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.speculative import ProposerContext, SpeculativeProposer
from tokenmill.interfaces.structured_output import StructuredOutputBackend, StructuredOutputContext

log = structlog.get_logger("tokenmill.builder")

#: what structured_outputs.backend "auto" tries, in order (vLLM's default is xgrammar too),
#: with the library each needs
_AUTO_BACKENDS = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def build_engine(config: EngineConfig, pm: Optional[PluginManager] = None) -> LLMEngine | EmbeddingEngine:
    """A generation engine, or an embedding engine when the architecture is an encoder."""
    if config.model is None:
        raise ConfigError("model", "no model given: pass a model directory or set 'model' in the YAML")
    _async_scheduling(config)  # an impossible request is refused before anything starts
    pm = pm or make_plugin_manager()
    components = collect_components(pm)
    platform = select_platform(components.platforms, config)
    freeze_import_heap()
    platform.setup_process()
    if config.parallel.world_size == 1:
        group, parallel = None, SINGLE  # one rank: nothing to start, whichever executor was named
    else:
        group, parallel = _start_workers(config, components, platform)
    try:
        engine = _build_engine(config, pm, components, platform, parallel, group)
    except BaseException:
        if group is not None:
            group.shutdown()
        raise
    return engine


def _async_scheduling(config: EngineConfig, platform: Optional[Platform] = None) -> bool:
    """Whether the engine schedules a step ahead: as asked, or (auto) where the model runs on
    a device other than the host and the engine can. What it cannot serve yet is refused:
    drafts need the verified tokens on the host before the next step, and the ranks of a
    multi-process model would each need the tokens that only the driver samples."""
    requested = config.scheduler.async_scheduling
    servable = not config.speculative.enabled and config.parallel.world_size == 1
    if requested is None:
        return servable and platform is not None and platform.device_type != "cpu"
    if not requested:
        return False
    if config.speculative.enabled:
        raise ConfigError("async_scheduling", "async scheduling does not work with speculative decoding yet: "
                                              "turn one of them off")
    if config.parallel.world_size > 1:
        raise ConfigError("async_scheduling", "async scheduling needs one process: tensor_parallel_size and "
                                              "pipeline_parallel_size must be 1 (pipeline parallelism keeps "
                                              "several batches in flight of its own)")
    return True


def _build_engine(config: EngineConfig, pm: PluginManager, components: Components, platform: Platform,
                  parallel: ParallelContext, group: Optional[WorkerGroup]) -> LLMEngine | EmbeddingEngine:
    built = build_model(config, components, pm, platform, parallel)
    model_config, model = built.model_config, built.model
    _check_scheduler_limits(config, model_config)
    policy = components.scheduling_policies.get(config.scheduler.policy)(config.scheduler)
    tokenizer = AutoTokenizer.from_pretrained(
        config.tokenizer or config.model, trust_remote_code=config.trust_remote_code
    )
    if built.is_embedding_model:
        engine = EmbeddingEngine(config, model_config, tokenizer, model, Pooler.from_model_dir(model_config.path),
                                 pm, config.scheduler.max_num_batched_tokens, platform)
        log.info("embedding engine built", model=str(model_config.path), architecture=model_config.architecture,
                 pooling=engine.pooler.mode, normalize=engine.pooler.normalize)
        pm.hook.engine_started(engine=engine)
        return engine

    proposer_models: list[LocalProposerModel] = []  # loaded now, bound to the blocks below
    speculator = _speculator(config, components, pm, platform, model_config, proposer_models)
    if proposer_models and config.enable_sleep_mode:
        raise ConfigError("enable_sleep_mode", "sleep frees the served model's weights and KV cache only, and the "
                                               "speculative proposer's model would keep its own: turn one of them off")
    kv_blocks, host_blocks = built.kv_capacity(config, platform, sum(m.kv_bytes_per_block() for m in proposer_models))
    if group is not None:  # every rank holds as many blocks as the smallest can
        for ready in group.wait_ready():
            kv_blocks, host_blocks = min(kv_blocks, ready.kv_blocks), min(host_blocks, ready.host_blocks)
    num_blocks = _num_kv_blocks(config, model_config, kv_blocks, platform.profiles_memory)
    if group is not None:
        group.send(Setup(num_blocks, host_blocks))
    swap_caches = built.allocate_caches(config, platform, num_blocks, host_blocks)
    # a draft model records its decode passes where the engine records its own (it runs on the
    # driver alone, unsharded, but a multi-process engine records no graphs at all)
    graph_sizes = config.compilation_config.capture_sizes(config.scheduler.max_num_seqs)
    for proposer_model in proposer_models:
        proposer_model.bind(num_blocks, speculator.proposer.num_lookahead_slots,
                            [] if config.enforce_eager or group else graph_sizes)
    kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.prefix_caching)
    swap_space = SwapSpace(host_blocks) if config.scheduler.preemption_mode == "swap" else None
    adapters = built.adapters
    async_scheduling = _async_scheduling(config, platform)
    scheduler = Scheduler(config.scheduler, kv_cache, policy, swap_space,
                          max_adapters=adapters.max_active if adapters else None, pipeline_depth=parallel.pp_size,
                          num_lookahead_slots=speculator.proposer.num_lookahead_slots if speculator else 0,
                          async_scheduling=async_scheduling)
    # the step's fast paths (the platform's greedy head, decode graphs): one rank, no per-step adapter state
    one_plain_rank = not (adapters or group)
    greedy_head = platform.greedy_head(model) if one_plain_rank and config.compilation_config.platform_kernels else None
    graphs_possible = one_plain_rank and built.backend.capabilities.cuda_graph
    record_graphs = None
    if config.enforce_eager and not graphs_possible:
        log.info("enforce_eager changes nothing here: this engine records no CUDA graphs (vLLM's meaning); "
                 "compilation_config {\"custom_ops\": [\"none\"]} turns the platform's kernels off")
    if graphs_possible and not config.enforce_eager:
        def record_graphs() -> Optional[DecodeGraphs]:
            return DecodeGraphs.for_engine(model, built.backend, platform, graph_sizes, config.cache.block_size,
                                           model_config.max_model_len, scheduler.num_lookahead_slots)
    staging = InputStaging.for_platform(platform, sets=2 if async_scheduling else 1)
    model_step = ModelStep(model, built.backend, config.cache.block_size, model_config.vocab_size, parallel,
                           swap_caches, adapters, greedy_head, staging,
                           record_graphs() if record_graphs is not None else None)
    local_control = WorkerControl(RankParts(config, components, platform, built, model_step, num_blocks,
                                            host_blocks, record_graphs))
    if group is not None:
        model_step = DistributedModelStep(model_step, group)
        adapters = DistributedAdapters(adapters, group) if adapters is not None else None
    context = LogitsProcessorContext(
        vocab_size=model_config.vocab_size, eos_token_ids=model_config.eos_token_ids,
        max_num_seqs=config.scheduler.max_num_seqs, device=torch.device(platform.device_type), tokenizer=tokenizer)
    structured = structured_outputs_manager(config, components, context)
    classes = logits_processor_classes(config, components, structured is not None)
    processors = tuple(cls(context, structured) if cls is StructuredOutput else cls(context) for cls in classes)
    runner = ModelRunner(model_step, config.seed, processors, config.logprobs_mode, async_scheduling, staging,
                         platform.noise_generator)
    engine = LLMEngine(config, model_config, tokenizer, scheduler, runner, pm, adapters, platform, structured, group,
                       speculator)
    engine.control = EngineControl(engine, ControlPlane(local_control, group,
                                                        config.parallel.distributed_timeout_seconds))
    # the build's temporaries (checkpoint tensors, plain weights replaced by packed ones, the
    # greedy head's fp64 norms): 650 MiB of a 52M fp32 engine's 1.47 GiB stayed resident without
    platform.release_memory()
    log.info("engine built", **platform.describe(), model=str(model_config.path),
             architecture=model_config.architecture,
             dtype=str(model_config.dtype).removeprefix("torch."), attention=built.backend.name,
             kv_cache_dtype=str(built.cache_dtype).removeprefix("torch."),
             policy=config.scheduler.policy, kv_blocks=num_blocks, async_scheduling=async_scheduling,
             max_model_len=model_config.max_model_len, tensor_parallel_size=parallel.tp_size,
             pipeline_parallel_size=parallel.pp_size, generation_config=config.generation_config,
             sampling_defaults=model_config.sampling_defaults)
    pm.hook.engine_started(engine=engine)
    return engine


def _for_workers(config: EngineConfig) -> EngineConfig:
    """The config with local paths made absolute: a worker may start in another directory
    (a Ray actor does)."""
    def absolute(path: Optional[str]) -> Optional[str]:
        return str(Path(path).resolve()) if path is not None and Path(path).exists() else path

    adapters = config.adapters.model_copy(update={"lora_modules": {
        name: absolute(path) for name, path in config.adapters.lora_modules.items()}})
    return config.model_copy(update={"model": absolute(config.model), "tokenizer": absolute(config.tokenizer),
                                     "adapters": adapters})


def _start_workers(config: EngineConfig, components: Components, platform: Platform
                   ) -> tuple[WorkerGroup, ParallelContext]:
    """Start ranks 1.., check they registered what the driver did, and join their groups."""
    parallel_config = config.parallel
    executor = components.executors.get(parallel_config.executor)()
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    group = WorkerGroup(executor, _for_workers(config).model_dump_json(), tp, pp,
                        parallel_config.distributed_timeout_seconds)
    try:
        group.check_fingerprints(components.fingerprint(),
                                 {rank: hello.fingerprint for rank, hello in group.hellos.items()})
        comm = Communicator(group.store, 0, tp, pp, platform.dist_backend,
                            parallel_config.distributed_timeout_seconds, platform.device_type)
    except BaseException:
        group.shutdown()
        raise
    log.info("workers started", executor=executor.name, world_size=tp * pp,
             workers=[f"rank {h.rank}: pid {h.pid} on {h.host}" for _, h in sorted(group.hellos.items())])
    return group, ParallelContext(tp, 0, pp, 0, comm)


def _speculator(config: EngineConfig, components: Components, pm: PluginManager, platform: Platform,
                model_config: ModelConfig, loaded: list[LocalProposerModel]) -> Optional[Speculator]:
    """The configured proposer, or None when speculative decoding is off. The models it
    loads are appended to ``loaded``, whose KV caches the engine binds once it has sized them."""
    spec = config.speculative
    if not spec.enabled:
        return None
    cls = components.speculative_proposers.get(spec.method)
    if not (isinstance(cls, type) and issubclass(cls, SpeculativeProposer)):
        raise ConfigError("speculative.method", f"{spec.method!r} is not a SpeculativeProposer "
                                                "(tokenmill.interfaces.speculative)")
    context = ProposerContext(
        num_speculative_tokens=spec.num_speculative_tokens, options=spec.model_dump(),
        vocab_size=model_config.vocab_size, max_model_len=model_config.max_model_len,
        load_model=lambda path: _loaded(load_proposer_model(path, config, components, pm, platform,
                                                            model_config.max_model_len), loaded),
        block_size=config.cache.block_size)
    proposer = cls(context)
    log.info("speculative decoding", method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
             disable_by_batch_size=spec.disable_by_batch_size, **(proposer.describe() or {}))
    return Speculator(proposer, spec.num_speculative_tokens, model_config.vocab_size, spec.disable_by_batch_size)


def _loaded(model: LocalProposerModel, loaded: list[LocalProposerModel]) -> LocalProposerModel:
    loaded.append(model)
    return model


def logits_processor_classes(config: EngineConfig, components: Components,
                             structured: bool) -> tuple[type[LogitsProcessor], ...]:
    """The engine's logits processors: the structured output one where a backend is
    (``structured``), the built-ins, then the configured ones (registered names or
    ``module:Class`` paths). An API server in a process of its own checks requests against
    their ``validate_params`` too."""
    classes: list[type[LogitsProcessor]] = ([StructuredOutput] if structured else []) + list(BUILTIN_LOGITS_PROCESSORS)
    for name in config.logits_processors:
        if name in components.logits_processors:
            cls = components.logits_processors.get(name)
        else:
            cls = import_class_path(name, "logits_processors", components.logits_processors.names())
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError("logits_processors", f"{name!r} is not a LogitsProcessor subclass "
                              "(tokenmill.interfaces.logits_processor)")
        classes.append(cls)
    return tuple(classes)


def structured_outputs_manager(config: EngineConfig, components: Components,
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
    return StructuredOutputManager(name, lambda: _backend_class(components, name)(backend_context),
                                   config.structured_outputs.disable_additional_properties)


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


def _num_kv_blocks(config: EngineConfig, model_config: ModelConfig, capacity: int, fills_budget: bool) -> int:
    """The KV blocks to allocate: what the memory budget holds (``capacity``, the smallest
    rank's). A device whose budget is a share of its own memory (``fills_budget``: a GPU's
    ``gpu_memory_utilization``) takes all of it, as vLLM does: the blocks beyond what
    max_num_seqs sequences of max_model_len tokens use keep finished prompts in the prefix
    cache. Host memory (the CPU's ``cache.kv_cache_memory``) is shared with everything else,
    so there the cache stops at what those sequences can use."""
    block_size = config.cache.block_size
    blocks_per_seq = -(-model_config.max_model_len // block_size)
    if config.cache.num_blocks is not None:
        num_blocks, source = config.cache.num_blocks, "cache.num_blocks"
    else:
        num_blocks = capacity if fills_budget else min(capacity, blocks_per_seq * config.scheduler.max_num_seqs)
        source = "cache.kv_cache_memory"
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            source,
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than one "
            f"sequence of max_model_len={model_config.max_model_len} needs ({blocks_per_seq}); "
            "give it more memory or lower max_model_len",
        )
    return num_blocks

"""A proposer's model: built like the engine's own (platform, dtype, attention backend), in
this process, with a KV cache of its own over the engine's block layout.

Sharing the block layout means a proposer needs no KV manager: a request's draft KV lives
at the same block ids as its target KV, in the draft model's cache tensors. The scheduler
reserves ``num_lookahead_slots`` past each request's tokens for the draft positions. The
engine loads proposer models before it sizes the KV cache, so ``cache.kv_cache_memory``
covers both caches; it binds their caches once the number of blocks is known.
"""

from __future__ import annotations

from typing import Sequence

import structlog

from tokenmill.core.config.engine_config import AdaptersConfig, EngineConfig, QuantizationConfig
from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.plugin_host.components import Components
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.kv_cache import allocate_kv_caches
from tokenmill.core.worker.model_builder import BuiltModel, build_model
from tokenmill.core.worker.model_step import ModelStep
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.parallel import SINGLE
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.speculative import ForwardRow

log = structlog.get_logger("tokenmill.speculative")


class LocalProposerModel:
    """Implements ``tokenmill.interfaces.speculative.ProposerModel`` over a ModelStep."""

    def __init__(self, built: BuiltModel, model_step: ModelStep, platform: Platform) -> None:
        self.built = built
        self.model_step = model_step
        self.platform = platform
        self.vocab_size = model_step.vocab_size

    def kv_bytes_per_block(self) -> int:
        return self.built.kv_bytes_per_block(self.model_step.block_size)

    def allocate_caches(self, num_blocks: int) -> None:
        built = self.built
        allocate_kv_caches(built.model, built.backend, num_blocks, self.model_step.block_size, built.cache_dtype,
                           self.platform.device_type)
        log.info("draft model KV cache", kv_cache_mib=round(self.kv_bytes_per_block() * num_blocks / 2**20, 2))

    def next_tokens(self, rows: Sequence[ForwardRow]) -> list[int]:
        ends, total = [], 0
        for row in rows:
            total += len(row.token_ids)
            ends.append(total - 1)
        step = Step([Row(tuple(r.token_ids), r.num_computed_tokens, tuple(r.block_ids), None) for r in rows],
                    ends, True)
        result = self.model_step.run(step)
        if result.tokens is not None:
            return result.tokens
        return result.logits.argmax(dim=-1).tolist()


def load_proposer_model(path: str, config: EngineConfig, components: Components, pm: PluginManager,
                        platform: Platform, max_model_len: int) -> LocalProposerModel:
    """The checkpoint at ``path`` as a proposer model able to hold ``max_model_len`` tokens
    (its KV cache is bound later, with ``allocate_caches``)."""
    draft_config = config.model_copy(update={
        "model": path, "tokenizer": None, "max_model_len": max_model_len,
        "adapters": AdaptersConfig(), "quantization": QuantizationConfig()})
    built = build_model(draft_config, components, pm, platform, SINGLE)
    if built.is_embedding_model:
        raise ConfigError("speculative.model", f"{path} is an embedding model, which cannot draft tokens")
    greedy_head = None if config.enforce_eager else platform.greedy_head(built.model)
    step = ModelStep(built.model, built.backend, config.cache.block_size, built.model_config.vocab_size,
                     greedy_head=greedy_head, staging=InputStaging.for_platform(platform))
    log.info("draft model loaded", model=path, architecture=built.model_config.architecture)
    return LocalProposerModel(built, step, platform)

"""A proposer's model: built like the engine's own (platform, dtype, attention backend), in
this process, with a KV cache of its own over the engine's block layout.

Sharing the block layout means a proposer needs no KV manager: a request's draft KV lives
at the same block ids as its target KV, in the draft model's cache tensors. The scheduler
reserves ``num_lookahead_slots`` past each request's tokens for the draft positions. The
engine loads proposer models before it sizes the KV cache, so ``cache.kv_cache_memory``
covers both caches; it binds their caches once the number of blocks is known.

A proposer decodes one token per request and forward pass, k passes a step: on a GPU each is
bound by its kernel launches, as the target's decode steps are, so where the engine records
its own decode steps (CUDA graphs) a proposer model records its own too, over its cache.
"""

from __future__ import annotations

from typing import Sequence, Union

import structlog
import torch

from tokenmill.core.config.engine_config import AdaptersConfig, EngineConfig, QuantizationConfig
from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.plugin_host.components import Components
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.core.worker.decode_graphs import DecodeGraphs
from tokenmill.core.worker.input_staging import InputStaging
from tokenmill.core.worker.kv_cache import allocate_kv_caches
from tokenmill.core.worker.model_builder import BuiltModel, build_model
from tokenmill.core.worker.model_step import ModelStep, StepResult
from tokenmill.core.worker.placeholder_tokens import PlaceholderTokens
from tokenmill.interfaces.batch import PLACEHOLDER_TOKEN
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.parallel import SINGLE
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.speculative import ForwardRow

log = structlog.get_logger("tokenmill.speculative")

#: a pass's tokens: read on the host already, or still on the model's device
Tokens = Union[list[int], torch.Tensor]


def _on_host(passes: list[Tokens]) -> list[list[int]]:
    """Every pass's tokens as lists, with one read of the device for all of those still there."""
    on_device = [tokens for tokens in passes if isinstance(tokens, torch.Tensor)]
    values = iter(torch.cat(on_device).tolist() if on_device else ())
    return [tokens if isinstance(tokens, list) else [next(values) for _ in range(len(tokens))] for tokens in passes]


class LocalProposerModel:
    """Implements ``tokenmill.interfaces.speculative.ProposerModel`` over a ModelStep, in
    forward passes of at most ``max_tokens`` tokens (the engine's ``max_num_batched_tokens``):
    a proposer's first rows are whole prompts, which the memory profile never sized."""

    def __init__(self, built: BuiltModel, model_step: ModelStep, platform: Platform, max_tokens: int,
                 max_model_len: int) -> None:
        self.built = built
        self.model_step = model_step
        self.platform = platform
        self.vocab_size = model_step.vocab_size
        self.max_tokens = max(1, max_tokens)
        self.max_model_len = max_model_len

    def kv_bytes_per_block(self) -> int:
        return self.built.kv_bytes_per_block(self.model_step.block_size)

    def bind(self, num_blocks: int, lookahead_slots: int, graph_sizes: list[int]) -> None:
        """Allocate the KV cache of ``num_blocks`` blocks, then record the decode passes of
        ``graph_sizes`` rows over it (none: no graphs; the engine passes its own sizes where it
        records graphs, the backend permitting): a recording holds the cache's addresses."""
        built, step = self.built, self.model_step
        allocate_kv_caches(built.model, built.backend, num_blocks, step.block_size, built.cache_dtype,
                           self.platform.device_type)
        log.info("draft model KV cache", kv_cache_mib=round(self.kv_bytes_per_block() * num_blocks / 2**20, 2))
        if graph_sizes and built.backend.capabilities.cuda_graph:
            step.graphs = DecodeGraphs.for_engine(built.model, built.backend, self.platform, graph_sizes,
                                                  step.block_size, self.max_model_len, lookahead_slots)

    def greedy_decode(self, rows: Sequence[ForwardRow], num_tokens: Sequence[int]) -> list[list[int]]:
        passes = [self._first_tokens(rows)]
        active = list(range(len(rows)))
        order = [active]  # the rows of each pass, in its tokens' order
        for step in range(1, max(num_tokens, default=0)):
            before = {row: index for index, row in enumerate(active)}
            active = [i for i in active if num_tokens[i] > step]
            if not active:
                break
            last, fill = passes[-1], None
            if isinstance(last, list):  # read on the host already (the CPU's greedy head)
                fed = [last[before[i]] for i in active]
            else:  # on the device: placeholders, filled there from the last pass's tokens
                fed = [PLACEHOLDER_TOKEN] * len(active)
                fill = PlaceholderTokens(list(range(len(active))), [(last, before[i]) for i in active])
            pieces = [Row([token], rows[i].num_computed_tokens + len(rows[i].token_ids) + step - 1,
                          tuple(rows[i].block_ids), None) for i, token in zip(active, fed)]
            passes.append(self._tokens(self.model_step.run(Step(pieces, list(range(len(active))), True),
                                                           placeholders=fill)))
            order.append(active)
        drafts: list[list[int]] = [[] for _ in rows]
        for rows_of_pass, tokens in zip(order, _on_host(passes)):
            for i, token in zip(rows_of_pass, tokens):
                drafts[i].append(token)
        return drafts

    def _first_tokens(self, rows: Sequence[ForwardRow]) -> Tokens:
        """Each row's argmax next token, in row order."""
        found: list[Tokens] = []
        for batch in self._batches(rows):
            pieces, ends, total = [], [], 0
            for _, row, last in batch:
                pieces.append(row)
                total += len(row.token_ids)
                if last:
                    ends.append(total - 1)
            result = self.model_step.run(Step(pieces, ends, True))
            if ends:  # rows end in the order they come, so the batches' tokens are in row order
                found.append(self._tokens(result))
        if all(isinstance(tokens, list) for tokens in found):
            return [token for tokens in found for token in tokens]
        device = next(tokens.device for tokens in found if isinstance(tokens, torch.Tensor))
        # a greedy head's fallback to the logits in some batch (a row not finite): rare
        return torch.cat([tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, device=device)
                          for tokens in found])

    @staticmethod
    def _tokens(result: StepResult) -> Tokens:
        """A greedy pass's tokens: read on the host by the platform's greedy head (the CPU's),
        or else the argmax of the logits, left on the device for the next pass."""
        return result.tokens if result.tokens is not None else result.logits.argmax(dim=-1)

    def _batches(self, rows: Sequence[ForwardRow]) -> list[list[tuple[int, Row, bool]]]:
        """Forward passes of at most ``max_tokens`` tokens: each row cut into pieces that fit,
        tagged (row index, piece, whether it is the row's last, which samples). A row's pieces
        land in successive passes (each reads the KV the last one wrote): every piece but a
        row's last fills ``max_tokens``, so the next piece never fits beside it."""
        batches: list[list[tuple[int, Row, bool]]] = [[]]
        used = 0
        for index, row in enumerate(rows):
            ids, computed = tuple(row.token_ids), row.num_computed_tokens
            for start in range(0, len(ids), self.max_tokens):
                piece = ids[start:start + self.max_tokens]
                if used + len(piece) > self.max_tokens:
                    batches.append([])
                    used = 0
                batches[-1].append((index, Row(piece, computed + start, tuple(row.block_ids), None),
                                    start + len(piece) == len(ids)))
                used += len(piece)
        return [batch for batch in batches if batch]


def load_proposer_model(path: str, config: EngineConfig, components: Components, pm: PluginManager,
                        platform: Platform, max_model_len: int) -> LocalProposerModel:
    """The checkpoint at ``path`` as a proposer model able to hold ``max_model_len`` tokens
    (its KV cache is bound later, with ``bind``)."""
    draft_config = config.model_copy(update={
        "model": path, "tokenizer": None, "max_model_len": max_model_len,
        "adapters": AdaptersConfig(), "quantization": QuantizationConfig()})
    built = build_model(draft_config, components, pm, platform, SINGLE)
    if built.is_embedding_model:
        raise ConfigError("speculative.model", f"{path} is an embedding model, which cannot draft tokens")
    greedy_head = platform.greedy_head(built.model) if config.compilation_config.platform_kernels else None
    # two sets of staging buffers: a pass's inputs wait only for the copies of the pass before
    # last (each set's mark follows its replay), so the host builds a pass while the last one runs
    step = ModelStep(built.model, built.backend, config.cache.block_size, built.model_config.vocab_size,
                     greedy_head=greedy_head, staging=InputStaging.for_platform(platform, sets=2))
    log.info("draft model loaded", model=path, architecture=built.model_config.architecture)
    return LocalProposerModel(built, step, platform, config.scheduler.max_num_batched_tokens, max_model_len)

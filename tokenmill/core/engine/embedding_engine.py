"""The engine for encoder (embedding) models: tokenize, batch, encode, pool."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import ModelConfig
from tokenmill.core.engine.step_isolation import raise_if_fatal
from tokenmill.core.layers.pooler import Pooler
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.interfaces.errors import DeviceFailed, InvalidRequest
from tokenmill.interfaces.models import EmbeddingModel
from tokenmill.interfaces.platform import Platform


class EmbeddingEngine:
    """Embeds batches of texts or token ids. Not thread-safe: one caller at a time.

    A device error the platform calls fatal (a CUDA illegal address) stops it, as it stops a
    generation engine: ``error`` is set, every later call raises it, and the server's /health
    turns 503 (``tokenmill serve`` exits, so that a supervisor starts a fresh process)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any,
                 model: EmbeddingModel, pooler: Pooler, plugin_manager: PluginManager,
                 max_batch_tokens: int, platform: Optional[Platform] = None) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model = model
        self.pooler = pooler
        self.plugin_manager = plugin_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = min(model_config.max_model_len, pooler.max_seq_length or model_config.max_model_len)
        self.platform = platform
        self.error: Optional[DeviceFailed] = None

    def tokenize(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Texts (with the tokenizer's special tokens) or token ids, length-checked."""
        result = []
        for item in inputs:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise InvalidRequest("input", "inputs must not be empty")
            if len(ids) > self.max_model_len:
                raise InvalidRequest("input", f"an input has {len(ids)} tokens; this model embeds at most "
                                              f"{self.max_model_len}")
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise InvalidRequest("input", f"token ids must be integers in [0, {vocab})")
            result.append(ids)
        return result

    @property
    def is_classifier(self) -> bool:
        return bool(getattr(self.model, "is_classifier", False))

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """[n, hidden] float32 embeddings, in input order."""
        return self._pooled(token_ids, self.pooler, self.model_config.hf_config["hidden_size"])

    def classify(self, token_ids: list[list[int]]) -> torch.Tensor:
        """[n, labels] float32 logits of a classification head, in input order."""
        if not self.is_classifier:
            raise InvalidRequest("model", f"{self.model_config.architecture} has no classification head: classify "
                                          "needs a ...ForSequenceClassification checkpoint")
        return self._pooled(token_ids, self.model.classify, self.model.classifier.out_features)

    def _pooled(self, token_ids: list[list[int]], pool, width: int) -> torch.Tensor:
        if self.error is not None:  # a fresh exception: re-raising the kept one would grow its traceback
            raise DeviceFailed(str(self.error)) from self.error
        try:
            return self._batched(token_ids, pool, width)
        except Exception as exc:
            try:
                raise_if_fatal(self.platform, exc)
            except DeviceFailed as failed:
                self.error = failed
                raise
            raise

    @torch.inference_mode()
    def _batched(self, token_ids: list[list[int]], pool, width: int) -> torch.Tensor:
        """``pool(encoder states, mask)`` of every input, in input order, on the host. Batches
        similar lengths together; each batch's ids and mask go to the model's device."""
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        device = next(self.model.parameters()).device
        out = torch.empty(len(token_ids), width)
        pad = self.tokenizer.pad_token_id or 0
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * len(token_ids[order[end]]) <= self.max_batch_tokens:
                end += 1
            batch = [token_ids[i] for i in order[start:end]]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, seq in enumerate(batch):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            ids, mask = ids.to(device), mask.to(device)
            out[order[start:end]] = pool(self.model.encode(ids, mask), mask).cpu()
            start = end
        return out

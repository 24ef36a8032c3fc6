"""Pooling beside generation, vLLM's tasks: embed, classify, score.

Which a model does follows from its architecture: an encoder (``BertModel``) embeds; a
sequence classifier (``...ForSequenceClassification``: an encoder's, or a decoder's head
at the last token) classifies; a causal language model does neither, and is refused by
name. ``score`` compares texts by the cosine of their embeddings (what sentence-
transformers' ``similarity`` gives); a cross-encoder's pair scores are not supported.

Encoders run on the embedding engine; a decoder classifier's prompts go through the
generation engine's own model and KV cache (core/engine/prompt_forward.py), between steps.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.prompt_forward import head_outputs
from tokenmill.interfaces.errors import InvalidRequest

#: a text, or its token ids
PoolingInput = Union[str, Sequence[int]]


def tokenize(engine: Union[LLMEngine, EmbeddingEngine], items: Sequence[PoolingInput]) -> list[list[int]]:
    if not items:
        raise InvalidRequest("input", "no inputs given")
    if isinstance(engine, EmbeddingEngine):
        return engine.tokenize(items)
    return [engine.tokenize_prompt(item if isinstance(item, str) else {"prompt_token_ids": list(item)})[1]
            for item in items]


def embeddings(engine: Union[LLMEngine, EmbeddingEngine], token_ids: list[list[int]]) -> torch.Tensor:
    """[n, hidden] sentence embeddings (the model's pooling and normalization)."""
    if not isinstance(engine, EmbeddingEngine) or engine.is_classifier:
        raise InvalidRequest("model", f"{engine.model_config.architecture} is not an embedding model: embed and "
                                      "score need one (BertModel and the like)")
    return engine.embed(token_ids)


def class_logits(engine: Union[LLMEngine, EmbeddingEngine], token_ids: list[list[int]]) -> torch.Tensor:
    """[n, labels] logits of the model's classification head."""
    if isinstance(engine, EmbeddingEngine):
        return engine.classify(token_ids)
    if not engine.is_classifier:
        raise InvalidRequest("model", f"{engine.model_config.architecture} has no classification head: classify "
                                      "needs a ...ForSequenceClassification checkpoint")
    if engine.control is not None:
        engine.control.check_awake()
    return torch.cat(head_outputs(engine, token_ids, lambda n: [n - 1]))


def pooled(engine: Union[LLMEngine, EmbeddingEngine], token_ids: list[list[int]]) -> torch.Tensor:
    """What ``encode`` / ``/pooling`` return: a classifier's logits, else embeddings."""
    if isinstance(engine, LLMEngine) or engine.is_classifier:
        return class_logits(engine, token_ids)
    return embeddings(engine, token_ids)


def pair_up(text_1: Union[PoolingInput, Sequence[PoolingInput]],
            text_2: Union[PoolingInput, Sequence[PoolingInput]]) -> tuple[list[PoolingInput], list[PoolingInput]]:
    """vLLM's pairing: one first text against each second text, or N against N."""
    firsts, seconds = as_inputs(text_1), as_inputs(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise InvalidRequest("text_1", f"{len(firsts)} first texts for {len(seconds)} second texts: give one, or "
                                       "as many as the second")
    return firsts, seconds


def scores(engine: Union[LLMEngine, EmbeddingEngine], firsts: list[list[int]],
           seconds: list[list[int]]) -> torch.Tensor:
    """The cosine similarity of each pair's embeddings."""
    vectors = embeddings(engine, firsts + seconds)
    return torch.nn.functional.cosine_similarity(vectors[:len(firsts)], vectors[len(firsts):], dim=-1)


def as_inputs(value) -> list[PoolingInput]:
    """One input (a text or token ids) or a list of them, as a list."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)

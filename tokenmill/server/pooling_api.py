"""vLLM's pooling routes: ``/pooling`` (pooled vectors), ``/classify`` (label probabilities),
``/v1/score`` (text pairs' similarity) and ``/v1/rerank`` (documents ordered by their
similarity to a query), over core/engine/pooling.py.

A model answers the tasks its architecture has (an encoder embeds and scores, a
``...ForSequenceClassification`` classifies); another task is a 400 that says which models
do it. An encoder runs off the event loop, one batch at a time; a decoder's prompts are
engine calls, run between its steps where it steps (its thread, or its own process).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Callable, Literal, Optional, Union

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field

from tokenmill.core.engine import pooling
from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.engine_calls import run_call
from tokenmill.server.embeddings import MAX_INPUTS
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import OpenAIModel, Prompt


class PoolingRequest(OpenAIModel):
    model: Optional[str] = None
    input: Prompt = Field(description="Text, a list of texts, token ids, or a list of token-id lists.")


class ScoreRequest(OpenAIModel):
    model: Optional[str] = None
    text_1: Union[str, list[str]] = Field(description="One text, or one per text_2.")
    text_2: Union[str, list[str]] = Field(description="The texts to compare text_1 with.")


class RerankRequest(OpenAIModel):
    model: Optional[str] = None
    query: str
    documents: list[str] = Field(description="The documents to order by their similarity to the query.")
    top_n: int = Field(0, ge=0, description="How many to return, best first (0: all).")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] = Field(description="An encoder's embedding, or a classifier's logits.")


class ClassifyData(BaseModel):
    index: int
    label: str = Field(description="The most likely label (config.json's id2label).")
    probs: list[float]
    num_classes: int


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class _Listing(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: Usage


class PoolingResponse(_Listing):
    data: list[PoolingData]


class ClassifyResponse(_Listing):
    data: list[ClassifyData]


class ScoreResponse(_Listing):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="Best first.")


class PoolingRoutes:
    def __init__(self, served: Union[AsyncLLM, EmbeddingEngine], check_model: Callable[[Optional[str]], Any],
                 model_name: str) -> None:
        self.engine = served.engine if isinstance(served, AsyncLLM) else served
        self.served = served
        self.check_model = check_model
        self.model_name = model_name
        self._lock = threading.Lock()

    async def run(self, name: str, **kwargs: Any) -> torch.Tensor:
        """The pooling call ``name`` (``engine_calls``) where the engine may run it: as an
        engine call of a generation engine, or on a worker thread of an encoder's."""
        if isinstance(self.served, AsyncLLM):
            return await self.served.call(name, **kwargs)

        def locked():
            with self._lock:
                return run_call(self.engine, name, kwargs)

        return await asyncio.to_thread(locked)

    def token_ids(self, items: list) -> list[list[int]]:
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", "input")
        return pooling.tokenize(self.engine, items)

    def envelope(self, prefix: str, data: list, tokens: int) -> dict[str, Any]:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def add_pooling_routes(app: FastAPI, routes: PoolingRoutes) -> None:
    @app.post("/pooling", response_model=PoolingResponse)
    async def pool(body: PoolingRequest) -> dict[str, Any]:
        """vLLM: each input's pooled vector: an encoder's embedding, a classifier's logits."""
        routes.check_model(body.model)
        token_ids = routes.token_ids(pooling.as_inputs(body.input))
        vectors = await routes.run("pooled", token_ids=token_ids)
        data = [{"index": i, "object": "pooling", "data": v.tolist()} for i, v in enumerate(vectors)]
        return routes.envelope("pool", data, sum(map(len, token_ids)))

    @app.post("/classify", response_model=ClassifyResponse)
    async def classify(body: PoolingRequest) -> dict[str, Any]:
        """vLLM: each input's label probabilities and most likely label (classifiers)."""
        routes.check_model(body.model)
        token_ids = routes.token_ids(pooling.as_inputs(body.input))
        probs = (await routes.run("class_logits", token_ids=token_ids)).softmax(-1)
        labels = routes.engine.model_config.hf_config.get("id2label") or {}
        data = [{"index": i, "label": labels.get(str(int(p.argmax())), str(int(p.argmax()))), "probs": p.tolist(),
                 "num_classes": len(p)} for i, p in enumerate(probs)]
        return routes.envelope("classify", data, sum(map(len, token_ids)))

    async def score(body: ScoreRequest) -> dict[str, Any]:
        """vLLM: how alike each (text_1, text_2) pair is: the cosine of their embeddings."""
        routes.check_model(body.model)
        firsts, seconds = pooling.pair_up(body.text_1, body.text_2)
        first_ids, second_ids = routes.token_ids(firsts), routes.token_ids(seconds)
        values = await routes.run("scores", firsts=first_ids, seconds=second_ids)
        data = [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(values)]
        return routes.envelope("score", data, sum(map(len, first_ids + second_ids)))

    async def rerank(body: RerankRequest) -> dict[str, Any]:
        """vLLM / Jina / Cohere: the documents by their similarity to the query, best first."""
        routes.check_model(body.model)
        if not body.documents:
            raise APIError(400, "documents must not be empty", "documents")
        query_ids, document_ids = routes.token_ids([body.query]), routes.token_ids(body.documents)
        values = await routes.run("scores", firsts=query_ids * len(document_ids), seconds=document_ids)
        order = sorted(range(len(values)), key=lambda i: -float(values[i]))[:body.top_n or None]
        tokens = len(query_ids[0]) * len(document_ids) + sum(map(len, document_ids))
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": routes.model_name, "usage": {"total_tokens": tokens},
                "results": [{"index": i, "document": {"text": body.documents[i]},
                             "relevance_score": float(values[i])} for i in order]}

    for path in ("/v1/score", "/score"):
        app.post(path, response_model=ScoreResponse)(score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse)(rerank)

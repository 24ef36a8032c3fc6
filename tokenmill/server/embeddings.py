"""POST /v1/embeddings for encoder models, float or base64 encoded."""

from __future__ import annotations

import asyncio
import base64
import threading

from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import EmbeddingRequest

#: inputs per request, as OpenAI limits them
MAX_INPUTS = 2048


class EmbeddingService:
    """Runs the (synchronous) embedding engine off the event loop, one batch at a time."""

    def __init__(self, engine: EmbeddingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()

    def _embed(self, token_ids: list[list[int]]):
        with self._lock:
            return self.engine.embed(token_ids)

    async def create(self, body: EmbeddingRequest) -> dict:
        raw = body.input
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise APIError(400, "input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", "input")
        hidden = self.engine.model_config.hf_config["hidden_size"]
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"this model's embeddings have {hidden} dimensions", "dimensions")
        token_ids = self.engine.tokenize(items)
        vectors = await asyncio.to_thread(self._embed, token_ids)
        data = []
        for index, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                embedding = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(map(len, token_ids))
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

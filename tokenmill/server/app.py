"""create_app(): the OpenAI-compatible FastAPI application over an AsyncLLM."""

from __future__ import annotations

import asyncio
import inspect
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import tokenmill
from tokenmill.core.config.server_config import ServerConfig
from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.gc_heap import freeze_startup_heap
from tokenmill.core.plugin_host.registry import import_class_path
from tokenmill.interfaces.errors import ConfigError
from tokenmill.server.adapters import add_adapter_routes
from tokenmill.server.pooling_api import PoolingRoutes, add_pooling_routes
from tokenmill.server.training_api import add_training_routes
from tokenmill.server.chat import chat_prompt_ids, create_chat_completion
from tokenmill.server.tool_parsers import tool_parser_factory
from tokenmill.server.completions import create_completion
from tokenmill.server.embeddings import EmbeddingService
from tokenmill.server.engine_core.client import EngineCoreClient
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.generation import ServingContext
from tokenmill.server.logging import log_finished_requests
from tokenmill.server.reasoning import reasoning_parser
from tokenmill.server.responses_api import (
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    ResponseStreamEvent,
    create_response,
)
from tokenmill.core.engine.metrics import EngineMetrics
from tokenmill.server.middleware import APIKeyAuth, BodySizeLimit, JSONBodyCheck, RequestIdHeaders
from tokenmill.server.openapi import ERROR_RESPONSES, install_openapi, streamed
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    now,
)
from tokenmill.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeResponse,
    ErrorResponse,
    EmbeddingResponse,
    HealthResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)

log = structlog.get_logger("tokenmill.server")


def resolve_api_key(config: ServerConfig) -> Optional[str]:
    """The configured key, else TOKENMILL_API_KEY (read now, not at import), else none."""
    if config.api_key is not None:
        return config.api_key.get_secret_value()
    return os.environ.get("TOKENMILL_API_KEY") or None


def default_model_names(model: str) -> list[str]:
    """vLLM's rule: the ``model`` argument as given; its last path part is also accepted."""
    short = Path(model).name
    return [model] if short in ("", model) else [model, short]


def server_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a file's text, or the value itself where it is a Jinja template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError("chat_template", f"{value!r} is neither a readable file nor a Jinja template")


async def _watch_engine(llm: AsyncLLM | EmbeddingEngine, on_stopped: Callable[[], None]) -> None:
    """Wait until the engine stops on an error (its loop, or an embedding model's device); then
    /health says 503, every request in flight has failed with the reason, and ``on_stopped``
    runs."""
    while llm.error is None:
        await asyncio.sleep(0.2)
    log.error("the engine stopped; the server exits so that a supervisor can restart it", error=repr(llm.error))
    on_stopped()


def create_app(llm: AsyncLLM | EmbeddingEngine, config: Optional[ServerConfig] = None,
               on_engine_stopped: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app for a generation engine (wrapped in AsyncLLM) or an embedding engine.
    ``on_engine_stopped`` is called once the engine's loop has stopped on an error (a dead
    worker, a failed device): ``tokenmill serve`` exits then, so that a supervisor restarts it."""
    config = config or ServerConfig()
    generating = isinstance(llm, AsyncLLM)
    engine = llm.engine if generating else llm
    names = config.served_model_name or default_model_names(str(engine.config.model))
    ctx = ServingContext(llm if generating else None, names, engine.max_model_len, engine.tokenizer,
                         config.trust_request_chat_template, tool_parser_factory(config, engine),
                         chat_template=server_chat_template(config.chat_template),
                         reasoning_parser=reasoning_parser(config, engine) if generating else None,
                         return_tokens_as_token_ids=config.return_tokens_as_token_ids,
                         max_logprobs=config.max_logprobs,
                         stream_interval=config.stream_interval,
                         sampling_defaults=engine.model_config.sampling_defaults if generating else {},
                         response_role=config.response_role,
                         content_parts=config.chat_template_content_format == "openai",
                         prompt_tokens_details=config.enable_prompt_tokens_details,
                         constrain_reasoning=engine.config.structured_outputs.enable_in_reasoning)
    metrics = EngineMetrics(names[0])
    embeddings = None if generating else EmbeddingService(engine, names[0])
    #: an engine in its own process observes its steps there, and is asked for the text
    remote_metrics = isinstance(llm, EngineCoreClient)
    if generating and not remote_metrics:
        llm.observers += [metrics.observe_step] + ([log_finished_requests] if config.log_requests else [])

    def require(kind: str) -> None:
        if (kind == "generation") != generating:
            what = "generates text" if generating else "is an embedding model"
            raise APIError(400, f"the model `{names[0]}` {what}; this endpoint needs {kind}", "model")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        freeze_startup_heap()  # the app's routes and schemas too, now that they exist
        watcher = None
        if on_engine_stopped is not None:
            watcher = asyncio.get_running_loop().create_task(_watch_engine(llm, on_engine_stopped))
        yield
        if watcher is not None:
            watcher.cancel()
        if generating:
            llm.shutdown(config.drain_timeout)

    # /docs and /redoc from packaged Swagger UI and ReDoc files: a serving host often has no
    # route to a CDN
    described = dict(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, responses=ERROR_RESPONSES,
                     description="An OpenAI-compatible API with vLLM's extras. Every error is OpenAI's "
                                 "envelope `{\"error\": {message, type, param, code}}`.")
    if config.disable_fastapi_docs:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, **described)
    else:
        app = FastAPIOffline(**described)
    app.state.serving = ctx
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=streamed(CompletionStreamResponse, "The completion"))
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's legacy completions, with vLLM's sampling extras."""
        require("generation")
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=streamed(ChatCompletionChunk, "The chat completion"))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI's chat completions over the model's chat template, with vLLM's sampling extras."""
        require("generation")
        return await create_chat_completion(body, request, ctx)

    stored = ResponseStore()

    @app.post("/v1/responses", response_model=ResponseObject, responses=streamed(ResponseStreamEvent, "The response"))
    async def responses_create(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat completion path (text, instructions, function tools,
        text.format, usage), streamed as its semantic events or not."""
        require("generation")
        return await create_response(body, request, ctx, stored)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses={404: {"model": ErrorResponse}})
    async def responses_retrieve(response_id: str):
        """A stored response (the last 1,024 created with store true)."""
        return stored.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject,
              responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def responses_cancel(response_id: str):
        """OpenAI's answer for a response that is not a background one: it cannot be cancelled."""
        stored.get(response_id)
        raise APIError(400, "Cannot cancel a synchronous response.", "response_id")

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def create_embeddings(body: EmbeddingRequest):
        """Embeddings from an encoder model (the server must serve one)."""
        require("embeddings")
        ctx.check_model(body.model)
        return await embeddings.create(body)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        """The served model names, then the loaded LoRA adapters."""
        created = now()
        base = [{"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                 "root": str(engine.config.model), "parent": None, "max_model_len": engine.max_model_len}
                for name in names]
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "tokenmill", "root": path,
                     "parent": names[0], "max_model_len": engine.max_model_len}
                    for name, path in sorted(ctx.adapters().items())]
        return {"object": "list", "data": base + adapters}

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest):
        """vLLM: the token ids of a prompt, or of a conversation rendered by the chat template."""
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = chat_prompt_ids(ctx, body.messages)
        else:
            tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest):
        """vLLM: the text of token ids."""
        ctx.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/health", response_model=HealthResponse, response_model_exclude_none=True,
             responses={503: {"model": HealthResponse}})
    async def health():
        """200 while the engine serves; 503 with the reason once it stopped."""
        if llm.error is not None:
            return JSONResponse({"status": "error", "detail": repr(llm.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        """Prometheus text format, vLLM's metric names with the ``tokenmill:`` prefix."""
        text = await llm.metrics_text() if remote_metrics else generate_latest(metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    if generating and engine.config.adapters.allow_runtime_lora_updating:
        add_adapter_routes(app, llm, engine.config.adapters.allowed_lora_dirs, names)
    if generating and config.enable_training_endpoints:
        add_training_routes(app, llm)
    add_pooling_routes(app, PoolingRoutes(llm, ctx.check_model, names[0]))
    engine.plugin_manager.hook.extend_server(app=app)
    install_openapi(app, [CompletionStreamResponse, ChatCompletionChunk, ResponseStreamEvent])
    # added innermost first, so a request meets: CORS (a preflight is answered there, and
    # every response, a 401 too, gets its headers), request id, size limit, auth, JSON check
    app.add_middleware(JSONBodyCheck)
    app.add_middleware(APIKeyAuth, api_key=resolve_api_key(config))
    app.add_middleware(BodySizeLimit, max_bytes=int(config.max_request_body_bytes))
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdHeaders)
    if config.allowed_origins:  # none: browsers on other origins are refused (no CORS headers)
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials,
                           expose_headers=["X-Request-Id"] if config.enable_request_id_headers else [])
    for path in config.middleware:  # outermost, as vLLM adds them
        middleware = user_middleware(path)
        if isinstance(middleware, type):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    return app


def user_middleware(path: str) -> Any:
    """``--middleware PATH``: a class is ASGI middleware (``app.add_middleware``), an async
    function an HTTP middleware (``async def f(request, call_next)``), as vLLM takes them."""
    middleware = import_class_path(path, "server.middleware", [])
    if not (isinstance(middleware, type) or inspect.iscoroutinefunction(middleware)):
        raise ConfigError("server.middleware", f"{path!r} is neither an ASGI middleware class nor an async "
                                               "function (request, call_next)")
    return middleware

"""The ``server`` section: ``tokenmill serve``'s options, vLLM's flag names where vLLM has one."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ByteSize, Field, SecretStr

from tokenmill.core.config.strict import STRICT


class ServerConfig(BaseModel):
    model_config = STRICT

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: bearer token for /v1/*; unset falls back to the TOKENMILL_API_KEY env var, then to none
    api_key: Optional[SecretStr] = None
    #: names clients use in "model"; default (vLLM's rule): the model argument as given, the
    #: first name is the one responses report; the directory's own name is accepted as well
    served_model_name: Optional[list[str]] = None
    #: waiting requests beyond this get HTTP 503; None = unbounded
    max_queued_requests: Optional[int] = Field(None, ge=1)
    max_request_body_bytes: ByteSize = ByteSize(4 * 1024**2)
    #: accept a request's own ``chat_template`` (vLLM's --trust-request-chat-template): a
    #: template is a program, and one can keep the event loop busy for as long as it likes
    trust_request_chat_template: bool = False
    #: the chat template of every chat request, instead of the tokenizer's: a Jinja file's
    #: path, or the template itself (vLLM's --chat-template)
    chat_template: Optional[str] = None
    #: let the model decide when to call tools (tool_choice "auto"), read by tool_call_parser
    enable_auto_tool_choice: bool = False
    #: how tool calls are read from the model's text: a registered ToolParser ("hermes", "llama3_json")
    tool_call_parser: Optional[str] = None
    #: the most logprobs a request may ask for per token, sampled or prompt (vLLM: --max-logprobs);
    #: OpenAI's and the engine's limit is 20
    max_logprobs: int = Field(20, ge=0, le=20)
    #: a stream's tokens per chunk after its first, for requests that set none (vLLM: --stream-interval):
    #: fewer, larger chunks cost the server less per token, and clients see tokens later
    stream_interval: int = Field(1, ge=1)
    #: name tokens in logprobs as 'token_id:{id}' for every request (vLLM: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    #: how a reasoning model's thinking is told from its answer: a registered ReasoningParser
    #: ("deepseek_r1", "qwen3"); replies then carry it as reasoning_content
    reasoning_parser: Optional[str] = None
    #: the role a chat reply takes when the request adds the generation prompt (vLLM:
    #: --response-role); without it, the reply continues the last message and takes its role
    response_role: str = Field("assistant", min_length=1, max_length=64)
    #: how a message's content reaches the chat template (vLLM: --chat-template-content-format):
    #: "string" joins OpenAI's content parts into one text, "openai" passes the list of parts
    #: ({"type": "text", "text": ...}); "auto" is "string"
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    #: usage.prompt_tokens_details.cached_tokens in replies: the prompt tokens the prefix cache
    #: served (vLLM: --enable-prompt-tokens-details)
    enable_prompt_tokens_details: bool = False
    #: the training-loop endpoints (/pause, /resume, the weight-transfer cycle, /sleep,
    #: /wake_up, /reset_prefix_cache, /collective_rpc): they change what every client is served
    enable_training_endpoints: bool = False
    #: run the engine in a process of its own beside the HTTP server's, as vLLM runs its engine
    #: core: each has a GIL of its own, so streaming to many clients does not slow the steps
    engine_process: bool = False
    #: HTTP server processes in front of the engine, which then runs in a process of its own
    #: (vLLM: --api-server-count): each takes a share of the connections, and with it of the
    #: per-token work of streaming, which one event loop does at some tens of microseconds a
    #: token; 1 serves from this process
    api_server_count: int = Field(1, ge=1, le=64)
    #: ASGI middleware to add to the app, as import paths (vLLM: --middleware): a class is
    #: added with app.add_middleware, a function as an HTTP middleware (@app.middleware("http"))
    middleware: list[str] = []
    #: seconds in-flight requests may take to finish on shutdown
    drain_timeout: float = Field(10.0, ge=0)
    #: TLS (vLLM's flags): the private key and certificate chain files serve https
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    #: CA bundle client certificates are checked against (mutual TLS)
    ssl_ca_certs: Optional[str] = None
    #: client certificates: 0 not asked for, 1 checked if given, 2 required (Python's ssl.CERT_*)
    ssl_cert_reqs: Literal[0, 1, 2] = 0
    #: origins browsers may call the API from (CORS). Empty denies every cross-origin browser
    #: request; vLLM's default is "*", which lets any web page its user opens call a local server
    allowed_origins: list[str] = []
    allowed_methods: list[str] = ["*"]
    allowed_headers: list[str] = ["*"]
    allow_credentials: bool = False
    #: the path prefix a reverse proxy serves the app under (ASGI root_path)
    root_path: str = ""
    #: echo X-Request-Id (or a new one) on every response, and use it in logs and response ids
    enable_request_id_headers: bool = False
    #: no /docs, /redoc or /openapi.json
    disable_fastapi_docs: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: uvicorn's own log level (vLLM: --uvicorn-log-level); None follows log_level
    uvicorn_log_level: Optional[Literal["critical", "error", "warning", "info", "debug", "trace"]] = None
    #: one log line per finished request (vLLM: --enable-log-requests / --disable-log-requests)
    log_requests: bool = True
    #: "auto" = JSON lines unless stderr is a terminal
    log_format: Literal["auto", "json", "console"] = "auto"

"""The engine flags (one per vLLM engine argument, typed from the config tree) and the server
flags, and how a command's arguments become an EngineConfig."""

from __future__ import annotations

import argparse
import functools
import json
import typing
from typing import Any, Optional

from pydantic import BaseModel

from tokenmill.interfaces.errors import ConfigError, TokenmillError

#: other spellings of a flag: vLLM's short forms, and --platform for --device (vLLM's name)
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "device": ("--platform",)}


def add_engine_flags(parser: argparse.ArgumentParser, as_text: bool = False) -> None:
    """One flag per vLLM engine argument, typed from the config tree (or plain text, for
    comma-separated variant lists)."""
    from tokenmill.core.config.engine_config import EngineConfig
    from tokenmill.core.config.flat_names import VLLM_NAMES

    group = parser.add_argument_group("engine (vLLM names)")
    for name, dotted in VLLM_NAMES.items():
        if name == "model":
            group.add_argument("--model", default=None)
            continue
        annotation = _annotation(EngineConfig, dotted)
        flags = ["--" + name.replace("_", "-"), *_SHORT_FLAGS.get(name, ())]
        if as_text:
            group.add_argument(*flags, default=None, dest=name)
        elif annotation is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, dest=name)
        elif annotation is int:
            group.add_argument(*flags, type=int, default=None, dest=name)
        elif annotation is float:
            group.add_argument(*flags, type=float, default=None, dest=name)
        elif typing.get_origin(annotation) is list:
            group.add_argument(*flags, nargs="+", default=None, dest=name)
        else:
            group.add_argument(*flags, default=None, dest=name)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=None, help="port (default 8000)")
    group.add_argument("--api-key", default=None, help="require this bearer token on /v1/* "
                       "(default: $TOKENMILL_API_KEY if set)")
    group.add_argument("--served-model-name", nargs="+", default=None)
    group.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 when this many requests wait")
    group.add_argument("--max-request-body-bytes", default=None, help="e.g. 4MiB")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    group.add_argument("--log-format", choices=["auto", "json", "console"], default=None)
    group.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                       default=None, help="uvicorn's own log level (default: --log-level)")
    group.add_argument("--enable-log-requests", "--disable-log-requests", dest="enable_log_requests",
                       action=_LogRequests, nargs=0, default=None,
                       help="one log line per finished request (on by default; vLLM's spellings)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to serve; clients select one with the 'model' field")
    group.add_argument("--allowed-lora-dirs", nargs="+", default=None,
                       help="directories runtime adapter loads may read from")
    group.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                       help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter")
    group.add_argument("--trust-request-chat-template", action="store_true", default=None,
                       help="accept a chat_template in chat requests (off: a template is a program)")
    group.add_argument("--chat-template", default=None,
                       help="the chat template of every chat request: a Jinja file, or the template itself")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help='let chat requests use tool_choice "auto" (needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None,
                       help="how tool calls are read from replies: hermes, llama3_json, or a plugin's")
    group.add_argument("--max-logprobs", type=int, default=None,
                       help="the most logprobs a request may ask for per token (0-20; default 20)")
    group.add_argument("--stream-interval", type=int, default=None,
                       help="a stream's tokens per chunk after its first, unless a request sets stream_interval "
                            "(default 1: every step's)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                       help="name tokens in logprobs 'token_id:{id}' for every request (as a request can ask)")
    group.add_argument("--reasoning-parser", default=None,
                       help="read a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3, a plugin's")
    group.add_argument("--response-role", default=None,
                       help="the role of chat replies to a generation prompt (default assistant)")
    group.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default=None,
                       help="message content as one text (string; auto) or OpenAI's list of parts (openai)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true", default=None,
                       help="report usage.prompt_tokens_details.cached_tokens (prompt tokens from the prefix cache)")
    group.add_argument("--middleware", action="append", default=None, metavar="IMPORT.PATH",
                       help="ASGI middleware to add (repeatable): a class, or an HTTP middleware function")
    group.add_argument("--enable-training-endpoints", action="store_true", default=None,
                       help="serve /pause, /resume, the weight-transfer cycle, /sleep, /wake_up, "
                            "/reset_prefix_cache and /collective_rpc (off: they change what every client gets)")
    group.add_argument("--engine-process", action="store_true", default=None,
                       help="run the engine in a process of its own beside the HTTP server (vLLM's engine core): "
                            "streaming to many clients no longer takes the engine's time")
    group.add_argument("--api-server-count", type=int, default=None,
                       help="HTTP server processes in front of one engine process (the engine then runs in its own): "
                            "each serves a share of the connections (default 1)")
    group.add_argument("--ssl-keyfile", default=None, help="serve https with this private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA bundle client certificates are checked against")
    group.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=None,
                       help="client certificates: 0 not asked (default), 1 optional, 2 required (mutual TLS)")
    group.add_argument("--allowed-origins", nargs="+", type=_text_list, action="extend", default=None,
                       help="origins browsers may call from (CORS); default none. vLLM's JSON list works too")
    group.add_argument("--allowed-methods", nargs="+", type=_text_list, action="extend", default=None)
    group.add_argument("--allowed-headers", nargs="+", type=_text_list, action="extend", default=None)
    group.add_argument("--allow-credentials", action="store_true", default=None)
    group.add_argument("--root-path", default=None, help="the prefix a reverse proxy serves the app under")
    group.add_argument("--enable-request-id-headers", action="store_true", default=None,
                       help="echo X-Request-Id and use it in logs and response ids")
    group.add_argument("--disable-fastapi-docs", action="store_true", default=None,
                       help="no /docs, /redoc or /openapi.json")


class _LogRequests(argparse.Action):
    """``--enable-log-requests`` turns request lines on, ``--disable-log-requests`` off."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string == "--enable-log-requests")


def _text_list(value: str) -> list[str]:
    """One value, or vLLM's JSON list form (``'["https://a.example"]'``)."""
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [value]


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.core.config.flat_names import SERVER_NAMES, VLLM_NAMES

    names = list(VLLM_NAMES) + list(SERVER_NAMES)
    overrides = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if "lora_modules" in overrides:
        modules = {}
        for item in overrides["lora_modules"]:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError("lora_modules", f"expected NAME=PATH, got {item!r}")
            modules[name] = path
        overrides["lora_modules"] = modules
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        if name in overrides:
            overrides[name] = [item for items in overrides[name] for item in items]
    return overrides


def resolve_config(args: argparse.Namespace):
    """The EngineConfig for a command taking ``MODEL_OR_YAML``, ``--config`` and engine flags."""
    from tokenmill.core.config.engine_config import load_config

    yaml_path, overrides = config_sources(args)
    return load_config(yaml_path, **overrides)


def config_sources(args: argparse.Namespace) -> tuple[Optional[str], dict[str, Any]]:
    """(the YAML path or None, the flags given) of a command taking ``MODEL_OR_YAML``."""
    yaml_path, overrides = args.config, engine_overrides(args)
    target = getattr(args, "model_or_config", None)
    if target is not None:
        if target.endswith((".yaml", ".yml")):
            yaml_path = target
        else:
            overrides.setdefault("model", target)
    return yaml_path, overrides


def _annotation(model: type[BaseModel], dotted: str) -> Any:
    """The type of the config value at ``dotted``; a platform's section (``platform.cpu.*``)
    is typed by that platform's options model, or untyped where it cannot be imported."""
    node: Any = model
    for part in dotted.split("."):
        if part in node.model_fields:
            node = node.model_fields[part].annotation
        else:
            node = _platform_options(part)
            if node is None:
                return None
    args = [a for a in typing.get_args(node) if a is not type(None)]
    if typing.get_origin(node) is typing.Union and len(args) == 1:
        return args[0]
    return node


@functools.cache
def _platform_options(name: str) -> Optional[type[BaseModel]]:
    from tokenmill.core.plugin_host.components import collect_components
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager

    try:
        return collect_components(make_plugin_manager()).platforms.get(name).options_model
    except TokenmillError:  # not registered, or not importable here
        return None

"""The ``tokenmill`` command: serve, generate, bench, compare, config explain, plugins, make-model.

Engine flags are vLLM's (``--max-num-seqs``, ``--enable-prefix-caching``,
...), generated from ``config.VLLM_NAMES`` so the CLI, ``LLM(...)`` and the
YAML tree never drift apart. Precedence: defaults < --config YAML <
TOKENMILL_* env < flags.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

import structlog
from pydantic import BaseModel

from tokenmill.interfaces.errors import ConfigError, TokenmillError
from tokenmill.server.vllm_flags import add_vllm_flags, already_so, expand_vllm_config, refusal


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    try:
        argv = expand_vllm_config(list(sys.argv[1:] if argv is None else argv))
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # logs go to stderr so stdout stays machine-readable (--json)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        return args.handler(args)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    # the metavar lists the public commands: _compare-worker is compare's internal helper
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{serve,generate,bench,compare,config,plugins,make-model}")

    plugins = commands.add_parser("plugins", help="list installed plugins and what they register")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(handler=_plugins)

    make = commands.add_parser("make-model", help="write a tiny random-weight model directory")
    make.add_argument("directory")
    make.add_argument("--arch", default="llama", help="tiny architecture key (default: llama)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--preset", help="a benchmark preset's shapes (52m, 350m, 1b, ...) instead of tiny ones")
    make.set_defaults(handler=_make_model)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("model_or_config", nargs="?",
                       help="model directory or engine YAML (default: the built-in demo model)")
    serve.add_argument("--config", help="engine YAML file")
    add_server_flags(serve)
    add_engine_flags(serve)
    add_vllm_flags(serve)
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="vLLM's benchmarks: throughput, latency, serve (each: --help)",
                                add_help=False)
    bench.add_argument("-h", "--help", action="store_true", help="show this help (a benchmark's own: BENCHMARK --help)")
    bench.add_argument("benchmark", nargs="?", choices=["throughput", "latency", "serve"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(handler=functools.partial(_bench, bench))

    config = commands.add_parser("config", help="inspect the resolved engine configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    explain = config_commands.add_parser(
        "explain", help="every setting, its value and its source (flag, TOKENMILL_* env, YAML line, default)")
    explain.add_argument("model_or_config", nargs="?", help="model directory or engine YAML")
    explain.add_argument("--config", help="engine YAML file")
    add_server_flags(explain)
    add_engine_flags(explain)
    explain.set_defaults(handler=_config_explain)

    compare = commands.add_parser("compare", help="run one workload through several engine variants")
    compare.add_argument("model_or_config", nargs="?", help="model directory or engine YAML")
    compare.add_argument("--config", action="append", default=[], help="engine YAML (repeat: one variant each)")
    compare.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                         help="vary any engine argument, e.g. --set enable_prefix_caching=true,false")
    compare.add_argument("--num-prompts", type=int, default=8)
    compare.add_argument("--input-len", type=int, default=64)
    compare.add_argument("--output-len", type=int, default=32)
    compare.add_argument("--temperature", type=float, default=0.0)
    compare.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts and sampling")
    compare.add_argument("--threads", type=int, default=1)
    compare.add_argument("--json", help="write the results to this JSON file")
    compare.add_argument("--png", help="write a bar chart (needs matplotlib)")
    add_engine_flags(compare, as_text=True)
    compare.set_defaults(handler=_compare)

    worker = commands.add_parser("_compare-worker")
    worker.set_defaults(handler=lambda args: __import__("tokenmill.compare").compare.run_worker() or 0)

    generate = commands.add_parser("generate", help="generate completions offline")
    generate.add_argument("model_or_config", nargs="?", help="model directory or engine YAML")
    generate.add_argument("--config", help="engine YAML file")
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed-sampling", type=int, default=None, dest="sampling_seed",
                          help="per-request sampling seed")
    generate.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(generate)
    generate.set_defaults(handler=_generate)
    return parser


#: vLLM's short spellings of engine flags
#: other spellings of a flag: vLLM's short forms, and --platform for --device (vLLM's name)
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "device": ("--platform",)}


def add_engine_flags(parser: argparse.ArgumentParser, as_text: bool = False) -> None:
    """One flag per vLLM engine argument, typed from the config tree (or plain text, for
    comma-separated variant lists)."""
    from tokenmill.core.config.engine_config import VLLM_NAMES, EngineConfig

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


def serve_flags() -> set[str]:
    """The flags ``tokenmill serve`` implements (not those it takes only to refuse by name)."""
    from tokenmill.server.vllm_flags import ALREADY_SO, REFUSED

    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings} - set(REFUSED) - set(ALREADY_SO)


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
    from tokenmill.core.config.engine_config import SERVER_NAMES, VLLM_NAMES

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


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import importlib

    if args.benchmark is None:
        (sys.stdout if args.help else sys.stderr).write(parser.format_help())
        return 0 if args.help else 2

    importlib.import_module(f"tokenmill.bench.{args.benchmark}").main(args.bench_args)
    return 0


def _config_explain(args: argparse.Namespace) -> int:
    from tokenmill.core.config.explain import explain, format_settings

    yaml_path, overrides = config_sources(args)
    print(format_settings(explain(yaml_path, **overrides)))
    return 0


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


def _plugins(args: argparse.Namespace) -> int:
    from tokenmill.core.plugin_host.components import collect_components
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
    from tokenmill.interfaces.hookspecs import HOOKSPEC_VERSION

    pm = make_plugin_manager()
    components = collect_components(pm)
    registered: dict[str, dict[str, list[str]]] = {name: {} for name in pm.info}
    for kind, registry in components.by_kind().items():
        for entry in registry.entries():
            registered.setdefault(entry.plugin, {}).setdefault(kind, []).append(entry.name)
    plugins = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "module": info.module,
            "hooks": sorted(impl.name for impl in pm.get_hookcallers(pm.get_plugin(info.name)) or []),
            "registers": registered.get(info.name, {}),
        }
        for info in pm.info.values()
    ]
    if args.json:
        print(json.dumps({"hookspec_version": HOOKSPEC_VERSION, "plugins": plugins}, indent=2))
        return 0
    print(f"hook spec version {HOOKSPEC_VERSION}")
    print(f"{'plugin':<20} {'distribution':<28} registers")
    for plugin in plugins:
        dist = f"{plugin['distribution']} {plugin['version']}"
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in plugin["registers"].items())
        print(f"{plugin['name']:<20} {dist:<28} {what or '(observers only)'}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from tokenmill import compare
    from tokenmill.core.config.engine_config import VLLM_NAMES

    base: dict[str, Any] = {}
    if args.model_or_config:
        if args.model_or_config.endswith((".yaml", ".yml")):
            args.config = [args.model_or_config, *args.config]
        else:
            base["model"] = args.model_or_config
    flags = {name: getattr(args, name) for name in VLLM_NAMES if name != "model" and getattr(args, name, None)}
    varied = {k: v for k, v in flags.items() if "," in v}
    base.update({k: v for k, v in flags.items() if "," not in v})
    spec = {"base": base, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "temperature": args.temperature, "seed": args.prompt_seed,
            "threads": args.threads}
    rows = compare.compare(spec, compare.variants_from(varied, args.set, args.config))
    compare.print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": spec, "results": rows}, indent=2))
    if args.png:
        compare.write_png(rows, args.png)
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from tokenmill.bench.common import PRESETS
    from tokenmill.testing.tiny_models import make_tiny_model

    if args.preset is not None and args.preset not in PRESETS:
        print(f"tokenmill make-model: unknown preset {args.preset!r}; known: {', '.join(sorted(PRESETS))}",
              file=sys.stderr)
        return 2
    path = make_tiny_model(args.arch, args.directory, seed=args.seed, **PRESETS.get(args.preset, {}))
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.demo_models import DEMO_MODEL
    from tokenmill.server.logging import configure_logging
    from tokenmill.server.transport import uvicorn_options

    refused = refusal(args)
    if refused is not None:  # before anything loads
        print(f"tokenmill serve: {refused}", file=sys.stderr)
        return 2
    config = resolve_config(args)
    transport = uvicorn_options(config.server)  # unreadable TLS files fail before the model loads
    configure_logging(config.server.log_level, config.server.log_format)
    if config.model is None:
        # clients name the demo model, not its path
        server = config.server.model_copy(update={"served_model_name": config.server.served_model_name
                                                  or [DEMO_MODEL.name]})
        config = config.model_copy(update={"model": str(DEMO_MODEL), "server": server})
    # the first line within a second of starting: importing torch and building the engine
    # (compiling the CPU kernels on a machine's first start) take a while, and say so as they go
    structlog.get_logger("tokenmill.serve").info("starting: importing torch, then building the engine",
                                                 model=config.model)
    accepted = already_so(args)
    if accepted:
        structlog.get_logger("tokenmill.serve").info("vLLM flags accepted, nothing to do", flags=accepted)
    import uvicorn

    from tokenmill.core.engine.async_llm import AsyncLLM
    from tokenmill.core.engine.builder import build_engine
    from tokenmill.core.engine.llm_engine import LLMEngine
    from tokenmill.server.app import create_app, server_chat_template, user_middleware

    server_chat_template(config.server.chat_template)  # a missing file fails before the model loads
    for path in config.server.middleware:
        user_middleware(path)
    engine = build_engine(config)
    served = AsyncLLM(engine, config.server.max_queued_requests) if isinstance(engine, LLMEngine) else engine
    server: Optional[uvicorn.Server] = None

    def exit_server() -> None:  # the engine stopped on an error: a supervisor starts a fresh process
        server.should_exit = True

    app = create_app(served, config.server, on_engine_stopped=exit_server)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port,
        log_level=config.server.uvicorn_log_level or config.server.log_level,
        access_log=config.server.log_level == "debug",
        timeout_graceful_shutdown=int(config.server.drain_timeout) + 1, **transport))
    server.run()
    return 1 if getattr(served, "error", None) is not None else 0


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.core.engine.llm import LLM
    from tokenmill.interfaces.types import SamplingParams

    llm = LLM(config=resolve_config(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    for output in llm.generate(args.prompt, params, use_tqdm=not args.json):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": output.prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{output.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What each ``tokenmill`` command runs, given its parsed arguments (an exit status back)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import structlog

from tokenmill.cli.flags import config_sources, resolve_config
from tokenmill.server.vllm_flags import already_so, refusal


def bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import importlib

    if args.benchmark is None:
        (sys.stdout if args.help else sys.stderr).write(parser.format_help())
        return 0 if args.help else 2

    importlib.import_module(f"tokenmill.bench.{args.benchmark}").main(args.bench_args)
    return 0


def config_explain(args: argparse.Namespace) -> int:
    from tokenmill.core.config.explain import explain, format_settings

    yaml_path, overrides = config_sources(args)
    print(format_settings(explain(yaml_path, **overrides)))
    return 0


def plugins(args: argparse.Namespace) -> int:
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


def compare(args: argparse.Namespace) -> int:
    from tokenmill import compare
    from tokenmill.core.config.flat_names import VLLM_NAMES

    base: dict[str, Any] = {}
    if args.model_or_config:
        if args.model_or_config.endswith((".yaml", ".yml")):
            args.config = [args.model_or_config, *args.config]
        else:
            base["model"] = args.model_or_config
    # --model too (vLLM's spelling; it wins over the positional, as in serve): comma-separated, it varies
    flags = {name: getattr(args, name) for name in VLLM_NAMES if getattr(args, name, None)}
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


def make_model(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.bench.common import PRESETS
    from tokenmill.testing.tiny_models import make_tiny_model

    if args.preset is not None and args.preset not in PRESETS:
        print(f"tokenmill make-model: unknown preset {args.preset!r}; known: {', '.join(sorted(PRESETS))}",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tokenmill make-model: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    path = make_tiny_model(args.arch, args.directory, seed=args.seed, device=args.device,
                           **PRESETS.get(args.preset, {}))
    print(path)
    return 0


def serve(args: argparse.Namespace) -> int:
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
    from tokenmill.core.engine.async_llm import AsyncLLM
    from tokenmill.core.engine.builder import build_engine
    from tokenmill.core.engine.llm_engine import LLMEngine
    from tokenmill.server.api_server import run_api_server
    from tokenmill.server.app import default_model_names, server_chat_template, user_middleware

    server_chat_template(config.server.chat_template)  # a missing file fails before the model loads
    for path in config.server.middleware:
        user_middleware(path)
    if config.server.api_server_count > 1:
        from tokenmill.server.engine_core.api_servers import serve_api_servers

        return serve_api_servers(config)
    if config.server.engine_process:
        from tokenmill.server.engine_core.client import EngineCoreClient

        model_name = (config.server.served_model_name or default_model_names(str(config.model)))[0]
        served = EngineCoreClient(config, model_name, config.server.max_queued_requests)
    else:
        engine = build_engine(config)
        served = AsyncLLM(engine, config.server.max_queued_requests) if isinstance(engine, LLMEngine) else engine
    return run_api_server(served, config, transport)


def generate(args: argparse.Namespace) -> int:
    from tokenmill.core.engine.llm import LLM
    from tokenmill.interfaces.sampling_params import SamplingParams

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

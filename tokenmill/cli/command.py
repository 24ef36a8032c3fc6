"""The ``tokenmill`` command: serve, generate, bench, compare, config explain, plugins, make-model.

Its parser and entry point (the console script ``tokenmill``; ``python -m tokenmill.cli``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional, Sequence

import structlog

from tokenmill.cli import subcommands
from tokenmill.cli.flags import add_engine_flags, add_server_flags
from tokenmill.interfaces.errors import TokenmillError
from tokenmill.server.vllm_flags import add_vllm_flags, expand_vllm_config


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
    except BrokenPipeError:  # `tokenmill plugins | head`: the reader has what it wanted
        # the interpreter flushes stdout at exit: into /dev/null, not the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    # the metavar lists the public commands: _compare-worker is compare's internal helper
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{serve,generate,bench,compare,config,plugins,make-model}")

    plugins = commands.add_parser("plugins", help="list installed plugins and what they register")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(handler=subcommands.plugins)

    make = commands.add_parser("make-model", help="write a tiny random-weight model directory")
    make.add_argument("directory")
    make.add_argument("--arch", default="llama", help="tiny architecture key (default: llama)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--preset", help="a benchmark preset's shapes (52m, 350m, 1b, 8b, ...) instead of tiny ones")
    make.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                      help="where the weights are drawn: cuda makes the 8b preset in seconds, the CPU in minutes")
    make.set_defaults(handler=subcommands.make_model)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("model_or_config", nargs="?",
                       help="model directory or engine YAML (default: the built-in demo model)")
    serve.add_argument("--config", help="engine YAML file")
    add_server_flags(serve)
    add_engine_flags(serve)
    add_vllm_flags(serve)
    serve.set_defaults(handler=subcommands.serve)

    bench = commands.add_parser("bench", help="vLLM's benchmarks: throughput, latency, serve (each: --help)",
                                add_help=False)
    bench.add_argument("-h", "--help", action="store_true", help="show this help (a benchmark's own: BENCHMARK --help)")
    bench.add_argument("benchmark", nargs="?", choices=["throughput", "latency", "serve"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(handler=functools.partial(subcommands.bench, bench))

    config = commands.add_parser("config", help="inspect the resolved engine configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    explain = config_commands.add_parser(
        "explain", help="every setting, its value and its source (flag, TOKENMILL_* env, YAML line, default)")
    explain.add_argument("model_or_config", nargs="?", help="model directory or engine YAML")
    explain.add_argument("--config", help="engine YAML file")
    add_server_flags(explain)
    add_engine_flags(explain)
    explain.set_defaults(handler=subcommands.config_explain)

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
    compare.set_defaults(handler=subcommands.compare)

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
    generate.set_defaults(handler=subcommands.generate)
    return parser



def serve_flags() -> set[str]:
    """The flags ``tokenmill serve`` implements (not those it takes only to refuse by name)."""
    from tokenmill.server.vllm_flags import ALREADY_SO, REFUSED

    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings} - set(REFUSED) - set(ALREADY_SO)

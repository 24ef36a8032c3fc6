"""The ``tokenmill`` command line.

Engine flags are vLLM's (``--max-num-seqs``, ``--enable-prefix-caching``,
...), generated from ``config.flat_names.VLLM_NAMES`` so the CLI, ``LLM(...)`` and the
YAML tree never drift apart. Precedence: defaults < --config YAML <
TOKENMILL_* env < flags.

``command`` holds the parser and the entry point, ``flags`` the engine and server flags and
how they become an EngineConfig, ``subcommands`` what each command runs.
"""

from tokenmill.cli.command import main

__all__ = ["main"]

"""Reasoning parsers (vLLM's ``--reasoning-parser``): ``deepseek_r1`` and ``qwen3``."""

from __future__ import annotations

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", "tokenmill.plugins.reasoning_parsers.think_tags:DeepSeekR1ReasoningParser")
    register("qwen3", "tokenmill.plugins.reasoning_parsers.think_tags:Qwen3ReasoningParser")

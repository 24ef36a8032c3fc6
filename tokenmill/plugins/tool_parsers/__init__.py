"""Tool-call parsers for ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser``): ``hermes``
(``<tool_call>`` blocks: Hermes, Qwen) and ``llama3_json`` (Llama 3.x JSON calls)."""

from __future__ import annotations

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "tokenmill.plugins.tool_parsers.hermes:HermesToolParser")
    register("llama3_json", "tokenmill.plugins.tool_parsers.llama3_json:Llama3JsonToolParser")

"""The server's tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``),
chosen among the registered ones when the app is built, so a wrong name fails at startup."""

from __future__ import annotations

from typing import Any, Callable, Optional

from tokenmill.core.config.server_config import ServerConfig
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.tool_parser import ToolParser


def tool_parser_factory(config: ServerConfig, engine: Any) -> Optional[Callable[[], ToolParser]]:
    """A new parser per choice (parsers keep streaming state), or None without auto tool choice."""
    if not config.enable_auto_tool_choice:
        return None
    if config.tool_call_parser is None:
        raise ConfigError("server.tool_call_parser", "--enable-auto-tool-choice needs --tool-call-parser")
    parsers = collect_components(engine.plugin_manager).tool_parsers
    cls = parsers.get(config.tool_call_parser)
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ConfigError("server.tool_call_parser", f"{config.tool_call_parser!r} is not a ToolParser")
    return lambda: cls(engine.tokenizer)

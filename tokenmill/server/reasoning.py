"""The server's reasoning parser (``--reasoning-parser NAME``), chosen among the registered
ones when the app is built, and the streamed split of one choice's text."""

from __future__ import annotations

from typing import Any, Optional

from tokenmill.core.config.engine_config import ServerConfig
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.reasoning_parser import ReasoningParser


def reasoning_parser(config: ServerConfig, engine: Any) -> Optional[ReasoningParser]:
    """The configured parser (parsers are pure: one serves every request), or None."""
    if config.reasoning_parser is None:
        return None
    registry = collect_components(engine.plugin_manager).reasoning_parsers
    if config.reasoning_parser not in registry:
        raise ConfigError("server.reasoning_parser", f"no reasoning parser {config.reasoning_parser!r}; "
                                                     f"registered: {', '.join(registry.names())}")
    cls = registry.get(config.reasoning_parser)
    if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
        raise ConfigError("server.reasoning_parser", f"{config.reasoning_parser!r} is not a ReasoningParser")
    return cls(engine.tokenizer)


class ReasoningStream:
    """One streamed choice: each call gives what is new in its reasoning and in its content."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._reasoning_sent = 0
        #: the content so far (what the tool-call reader streams from)
        self.content = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(the new reasoning, the new content) of the choice's ``text`` so far."""
        reasoning, content = self.parser.split(text, final)
        reasoning, content = reasoning or "", content or ""
        new_reasoning = reasoning[self._reasoning_sent:]
        self._reasoning_sent = len(reasoning)
        new_content, self.content = content[len(self.content):], content
        return new_reasoning, new_content

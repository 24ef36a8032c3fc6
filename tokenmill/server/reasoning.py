"""The server's reasoning parser (``--reasoning-parser NAME``), chosen among the registered
ones when the app is built, and the streamed split of one choice's text."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tokenmill.core.config.server_config import ServerConfig
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.reasoning_parser import ReasoningParser
from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.server.errors import APIError


def reasoning_parser(config: ServerConfig, engine: Any) -> Optional[ReasoningParser]:
    """The configured parser (parsers are pure: one serves every request), or None: the
    server's ``--reasoning-parser``, else the one ``--structured-outputs-config`` names."""
    name = config.reasoning_parser or engine.config.structured_outputs.reasoning_parser
    if name is None:
        return None
    registry = collect_components(engine.plugin_manager).reasoning_parsers
    if name not in registry:
        raise ConfigError("server.reasoning_parser", f"no reasoning parser {name!r}; "
                                                     f"registered: {', '.join(registry.names())}")
    cls = registry.get(name)
    if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
        raise ConfigError("server.reasoning_parser", f"{name!r} is not a ReasoningParser")
    return cls(engine.tokenizer)


def constraint_after_thinking(parser: ReasoningParser, tokenizer: Any, constraint: StructuredOutputsParams,
                              prompt_token_ids: list[int]) -> StructuredOutputsParams:
    """``constraint`` made to hold in the reply's answer only: from the tokens of the parser's
    end of thinking on, or from the start when the prompt has closed the thinking."""
    try:
        marker = parser.constraint_starts_after(tokenizer.decode(prompt_token_ids))
    except NotImplementedError as refused:
        raise APIError(400, str(refused), constraint.param) from None
    if marker is None:
        return constraint
    return dataclasses.replace(constraint, starts_after=tuple(tokenizer.encode(marker, add_special_tokens=False)))


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

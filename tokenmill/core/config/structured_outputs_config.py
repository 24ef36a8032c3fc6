"""The ``structured_outputs`` section: vLLM's ``--structured-outputs-config``."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, field_validator, model_validator

from tokenmill.core.config.strict import STRICT


class StructuredOutputsConfig(BaseModel):
    """vLLM's ``StructuredOutputsConfig`` (``--structured-outputs-config JSON``)."""

    model_config = STRICT

    #: the backend that compiles constraints: a registered name ("xgrammar", "guidance", a
    #: plugin's), or "auto" (xgrammar where installed, else guidance)
    backend: str = "auto"
    #: JSON is compiled with no free whitespace on every backend (False is refused: a weak
    #: model could fill its budget with spaces)
    disable_any_whitespace: bool = True
    #: every JSON schema object that does not say whether it takes other properties gets
    #: ``additionalProperties: false``, as a request's own field of that name asks
    disable_additional_properties: bool = False
    #: with a reasoning parser, the constraint holds in the thinking too (vLLM's field); by
    #: default it holds in the answer only, from the parser's end of thinking on
    enable_in_reasoning: bool = False
    #: vLLM's place for ``--reasoning-parser``: the server's parser where that flag is not given
    reasoning_parser: Optional[str] = None
    #: tokenmill never switches backends for a request ("auto" picks one at startup), so
    #: there is no fallback to disable: accepted either way
    disable_fallback: bool = False

    @model_validator(mode="before")
    @classmethod
    def _vllm_values(cls, value: Any) -> Any:
        """vLLM's empty strings unset a field; a reasoning-parser plugin file is refused."""
        if isinstance(value, dict):
            if value.get("reasoning_parser_plugin"):
                raise ValueError("reasoning_parser_plugin: reasoning parsers are plugins registered through "
                                 "entry points (the register_reasoning_parsers hook)")
            value = {k: v for k, v in value.items() if not (k in ("reasoning_parser", "reasoning_parser_plugin")
                                                           and v in ("", None))}
        return value

    @field_validator("disable_any_whitespace")
    @classmethod
    def _compact(cls, value: bool) -> bool:
        if not value:
            raise ValueError("JSON is compiled with no free whitespace (a weak model could fill its budget with "
                             "spaces); leave disable_any_whitespace true")
        return value

"""``tokenmill config explain``: every resolved setting, its value and where it came from.

Sources, highest first: a flag or argument, a ``TOKENMILL_*`` environment variable, the YAML
file (with its line), the default. Every problem is reported at once, each unknown key with
the nearest valid names ("did you mean"), instead of the first error alone.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from tokenmill.core.config.engine_config import (
    EngineConfig,
    environment_error,
    error_message,
    nest_overrides,
    validated_config,
)
from tokenmill.core.config.flat_names import SERVER_NAMES, VLLM_NAMES
from tokenmill.interfaces.errors import ConfigError

ENV_PREFIX = "TOKENMILL_"


@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    source: str


def explain(path: Optional[str | Path] = None, **overrides: Any) -> list[Setting]:
    """The settings ``load_config(path, **overrides)`` resolves, each with its source.

    Raises ConfigError listing every problem (with suggestions for unknown keys).
    """
    config = _resolve(path, overrides)
    flags = _leaves(nest_overrides({k: v for k, v in overrides.items() if v is not None}))
    lines = _yaml_lines(path) if path is not None else {}
    settings = []
    for key, value in _leaves(config.model_dump(mode="json")).items():
        env = ENV_PREFIX + key.upper().replace(".", "__")
        if key in flags:
            source = "flag"
        elif env in os.environ:
            source = f"env {env}"
        elif key in lines:
            source = f"{path}:{lines[key]}"
        else:
            source = "default"
        if key == "server.api_key" and value is not None:
            value = "**********"
        settings.append(Setting(key, value, source))
    return settings


def format_settings(settings: list[Setting]) -> str:
    width = max(len(s.key) for s in settings)
    return "\n".join(f"{s.key:<{width}}  {s.value!r:<30}  {s.source}" for s in settings)


def _resolve(path: Optional[str | Path], overrides: dict[str, Any]) -> EngineConfig:
    """The config, or a ConfigError listing every problem, with "did you mean" for unknown keys."""
    flat_names = set(VLLM_NAMES) | set(SERVER_NAMES) | set(EngineConfig.model_fields)
    problems = [_unknown(name, flat_names) for name in overrides if name not in flat_names]
    if not problems:
        try:
            return validated_config(path, **overrides)
        except SettingsError as exc:
            raise environment_error(exc) from None
        except ValidationError as exc:
            known = _known_keys(EngineConfig)
            problems = [_unknown(key, known) if error["type"] == "extra_forbidden" else f"{key}: {error_message(error)}"
                        for error in exc.errors() for key in [".".join(str(part) for part in error["loc"])]]
    raise ConfigError("config", "\n  " + "\n  ".join(problems))


def _unknown(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
    return f"{key}: unknown key" + (f"; did you mean {', '.join(close)}?" if close else "")


def _known_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= {prefix + name} | _known_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key not in ("lora_modules", "policy_config"):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _yaml_lines(path: str | Path) -> dict[str, int]:
    """Dotted key -> the 1-based line of the YAML file that sets it."""
    root = yaml.compose(Path(path).read_text())
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            walk(value_node, key + ".")

    if root is not None:
        walk(root, "")
    return lines

"""Name-keyed component registries with provenance and lazy imports."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from tokenmill.interfaces.errors import ComponentUnavailable, ConfigError, DuplicateComponent, UnknownComponent

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    factory: Callable[..., Any] | str
    plugin: str

    @property
    def target(self) -> str:
        """The factory as ``module:attr`` text, without importing it."""
        if isinstance(self.factory, str):
            return self.factory
        return f"{self.factory.__module__}:{self.factory.__qualname__}"


class Registry(Generic[T]):
    """Components of one kind (``"attention backend"``, ...) by name.

    A factory may be a lazy ``"module:attr"`` string: it is imported only by
    ``get``, so listing what is registered never imports heavy dependencies.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, factory: Callable[..., T] | str, *, plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings (plugin {plugin!r})")
        if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
            raise ValueError(
                f"{self.kind} {name!r} from plugin {plugin!r}: factory must be callable "
                f"or a 'module:attr' string, got {factory!r}"
            )
        if name in self._entries:
            raise DuplicateComponent(self.kind, name, self._entries[name].plugin, plugin)
        self._entries[name] = Entry(name, factory, plugin)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[name] for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``, imported if it was lazy."""
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownComponent(self.kind, name, self.names())
        if not isinstance(entry.factory, str):
            return entry.factory
        module_name, _, attr = entry.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ComponentUnavailable(
                f"{self.kind} {name!r} (plugin {entry.plugin!r}) cannot be imported "
                f"from {entry.factory!r}: {exc}"
            ) from exc
        return obj


def import_class_path(path: str, param: str, registered: list[str]) -> Any:
    """What a ``module:attr`` (or vLLM's ``module.attr``) path in the config names."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ConfigError(param, f"{path!r} is neither a registered name ({', '.join(registered) or 'none'}) "
                                 "nor a 'module:Class' path")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(param, f"cannot import {path!r}: {exc}") from exc
    return obj

"""The plugin manager: entry-point discovery, allowlist, tracing.

Environment variables are read when ``make_plugin_manager`` is called, never
at import, so tests and embedding applications can change them per engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Optional

import pluggy
import structlog

from tokenmill.interfaces import hookspecs
from tokenmill.interfaces.errors import ConfigError, DuplicateComponent, PluginLoadFailed

log = structlog.get_logger("tokenmill.plugins")

#: the distribution whose entry points are tokenmill's own plugins: always loaded
FIRST_PARTY = "tokenmill"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """Where a registered plugin came from."""

    name: str
    distribution: Optional[str]
    version: Optional[str]
    module: str


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus the provenance ``tokenmill plugins`` reports."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}

    def register_plugin(
        self,
        plugin: ModuleType | object,
        name: str,
        distribution: Optional[str] = None,
        version: Optional[str] = None,
    ) -> None:
        """Register a plugin under a unique name; a clash names both sources."""
        if name in self.info:
            first = self.info[name]
            raise DuplicateComponent(
                "plugin", name, f"{first.distribution or first.module}", distribution or _module_of(plugin)
            )
        self.register(plugin, name=name)
        self.info[name] = PluginInfo(name, distribution, version, _module_of(plugin))


def make_plugin_manager(*, autoload: Optional[bool] = None) -> PluginManager:
    """A fresh manager with tokenmill's own plugins and the allowed third-party ones.

    ``TOKENMILL_PLUGINS``: comma-separated distribution names allowed to load
    (unset = all, ``""`` = none besides tokenmill's own).
    ``TOKENMILL_DISABLE_PLUGIN_AUTOLOAD``: when true, no third-party entry point loads.
    ``TOKENMILL_TRACE_PLUGINS``: when true, every hook call is logged.
    """
    pm = PluginManager()
    if autoload is None:
        autoload = not _env_flag("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD")
    allowlist = _env_allowlist("TOKENMILL_PLUGINS")
    for ep in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else None
        first_party = dist is not None and _canonical(dist) == FIRST_PARTY
        if not first_party:
            if not autoload:
                continue
            if allowlist is not None and (dist is None or _canonical(dist) not in allowlist):
                log.debug("plugin skipped by allowlist", plugin=ep.name, distribution=dist)
                continue
        version = ep.dist.version if ep.dist else None
        try:
            plugin = ep.load()
        except Exception as exc:  # tokenmill's own plugins fail as they are: a bug, not a setup
            if first_party:
                raise
            raise PluginLoadFailed(ep.name, dist, version, exc) from exc
        pm.register_plugin(plugin, ep.name, dist, version)
    pm.check_pending()
    if _env_flag("TOKENMILL_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda message: log.info("hook", call=message.rstrip()))
        pm.enable_tracing()
    return pm


def _module_of(plugin: object) -> str:
    return getattr(plugin, "__name__", None) or type(plugin).__module__


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(name, f"expected a boolean (1/0, true/false), got {raw!r}")


def _env_allowlist(name: str) -> Optional[set[str]]:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {_canonical(part.strip()) for part in raw.split(",") if part.strip()}

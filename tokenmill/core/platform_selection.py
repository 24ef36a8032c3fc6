"""Choosing the platform, loudly: vLLM's users' main complaint is a platform that fails to load
and falls back to the CPU without a word.

``platform.name: auto`` asks every registered platform's ``detect()``, takes the usable one
with the highest priority, and logs at warning level why each one was rejected (a platform
that cannot even be imported is rejected with that error). An explicit name is used as it
is, or is an error that gives the platform's own reason.
"""

from __future__ import annotations

from typing import Any

import structlog

from tokenmill.core.registry import Registry
from tokenmill.interfaces.errors import ComponentUnavailable, ConfigError
from tokenmill.interfaces.platform import Detection, Platform

log = structlog.get_logger("tokenmill.platform")


def select_platform(name: str, registry: Registry, config: Any) -> Platform:
    """The platform ``name`` ("auto" or a registered name) means here, constructed with ``config``."""
    if name != "auto":
        cls = registry.get(name)  # UnknownComponent lists the registered names
        found = cls.detect()
        if not found.usable:
            raise ConfigError("platform.name", f"platform {name!r} cannot run here: {found.reason}")
        log.info("platform selected", platform=name, why=f"platform.name is {name!r}; {found.reason}")
        return cls(config)
    usable: list[tuple[int, str, type[Platform], Detection]] = []
    for entry_name in registry.names():
        try:
            cls = registry.get(entry_name)
            found = cls.detect()
        except ComponentUnavailable as exc:
            found = Detection(False, str(exc))
        if found.usable:
            usable.append((cls.priority, entry_name, cls, found))
        else:
            log.warning("platform not usable", platform=entry_name, reason=found.reason)
    if not usable:
        tried = ", ".join(registry.names()) or "none is registered"
        raise ConfigError("platform.name", f"no platform can run here (tried: {tried}); the warnings above say why")
    usable.sort(key=lambda item: -item[0])
    _, chosen, cls, found = usable[0]
    for _, other, _, _ in usable[1:]:
        log.warning("platform not chosen", platform=other, reason=f"{chosen!r} is usable and ranks higher")
    log.info("platform selected", platform=chosen, why=f"platform.name is 'auto'; {found.reason}")
    return cls(config)

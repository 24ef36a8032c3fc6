"""Choosing the platform, loudly: vLLM's users' main complaint is a platform that fails to load
and falls back to the CPU without a word.

``platform.name: auto`` asks every registered platform's ``detect()``, takes the usable one
with the highest priority, and logs at warning level why each one was rejected (a platform
that cannot even be imported is rejected with that error). An explicit name is used as it
is, or is an error that gives the platform's own reason.

The chosen platform's config section (``platform.<name>``) is validated by its
``options_model``; a section naming no registered platform is an error, and one for a
registered platform that was not chosen is ignored with a warning.
"""

from __future__ import annotations


import structlog
from pydantic import ValidationError

from tokenmill.core.config.engine_config import EngineConfig, config_error
from tokenmill.core.plugin_host.registry import Registry
from tokenmill.interfaces.errors import ComponentUnavailable, ConfigError
from tokenmill.interfaces.platform import Detection, Platform

log = structlog.get_logger("tokenmill.platform")


def select_platform(registry: Registry, config: EngineConfig) -> Platform:
    """The platform ``config.platform.name`` ("auto" or a registered name) means here,
    constructed with ``config`` and its validated section."""
    sections = config.platform.sections()
    for section in sections:
        if section not in registry:
            raise ConfigError(f"platform.{section}", f"no platform {section!r} is registered, so its options "
                              f"cannot apply; registered: {', '.join(registry.names()) or 'none'}")
    cls = _choose(config.platform.name, registry)
    for section, options in sections.items():
        if section != cls.name:  # vLLM's rule: a flag for another device is accepted, and said to do nothing
            log.warning("options ignored", section=f"platform.{section}",
                        flags=[f"--{key.replace('_', '-')}" for key in (options or {})],
                        reason=f"they concern the {section} platform, and {cls.name!r} was chosen")
    try:
        options = cls.options_model.model_validate(sections.get(cls.name, {}))
    except ValidationError as exc:
        raise config_error(exc, f"platform.{cls.name}") from None
    return cls(config, options)


def _choose(name: str, registry: Registry) -> type[Platform]:
    if name != "auto":
        cls = registry.get(name)  # UnknownComponent lists the registered names
        found = cls.detect()
        if not found.usable:
            raise ConfigError("platform.name", f"platform {name!r} cannot run here: {found.reason}")
        log.info("platform selected", platform=name, why=f"platform.name is {name!r}; {found.reason}")
        return cls
    usable: list[tuple[int, str, type[Platform], Detection]] = []
    unusable: list[tuple[str, str]] = []
    for entry_name in registry.names():
        try:
            cls = registry.get(entry_name)
            found = cls.detect()
        except ComponentUnavailable as exc:
            found = Detection(False, str(exc))
        if found.usable:
            usable.append((cls.priority, entry_name, cls, found))
        else:
            unusable.append((entry_name, found.reason))
    # a platform without its device here is expected (the cuda platform on a CPU machine):
    # info, unless nothing can run, when the reasons are the error's explanation
    report = log.info if usable else log.warning
    for entry_name, reason in unusable:
        report("platform not usable", platform=entry_name, reason=reason)
    if not usable:
        tried = ", ".join(registry.names()) or "none is registered"
        raise ConfigError("platform.name", f"no platform can run here (tried: {tried}); the warnings above say why")
    usable.sort(key=lambda item: -item[0])
    _, chosen, cls, found = usable[0]
    for _, other, _, _ in usable[1:]:
        log.info("platform not chosen", platform=other, reason=f"{chosen!r} is usable and ranks higher")
    log.info("platform selected", platform=chosen, why=f"platform.name is 'auto'; {found.reason}")
    return cls

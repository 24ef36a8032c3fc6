"""Typed errors: every bad input names the key or parameter it is about."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class ConfigError(TokenmillError, ValueError):
    """A configuration value is invalid; `key` is its dotted path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class InvalidRequest(TokenmillError, ValueError):
    """A request or sampling parameter is out of range; `param` names it."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


class UnknownComponent(TokenmillError, LookupError):
    """A config names a component that no installed plugin registered."""

    def __init__(self, kind: str, name: str, available: list[str], reason: str = "") -> None:
        listing = ", ".join(sorted(available)) or "none"
        why = f" ({reason})" if reason else ""
        super().__init__(f"unknown {kind} {name!r}{why}; available: {listing}")
        self.kind, self.name, self.available = kind, name, sorted(available)


class DuplicateComponent(TokenmillError):
    """Two plugins registered the same name for the same kind of component."""

    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        super().__init__(
            f"{kind} {name!r} is registered by both plugin {first!r} and plugin {second!r}"
        )
        self.kind, self.name, self.plugins = kind, name, (first, second)


class PluginLoadFailed(TokenmillError):
    """A third-party plugin's entry point raised while importing (a missing dependency, a
    plugin written against another tokenmill). Nothing is skipped silently: a plugin left out
    could be the platform or policy the user chose."""

    def __init__(self, name: str, distribution: str | None, version: str | None, error: BaseException) -> None:
        source = " ".join(["distribution", distribution] + ([version] if version else [])) if distribution \
            else "no distribution"
        super().__init__(
            f"plugin {name!r} ({source}) failed to import: {type(error).__name__}: {error}. Leave it out with "
            "TOKENMILL_PLUGINS (the distributions allowed to load) or TOKENMILL_DISABLE_PLUGIN_AUTOLOAD=1, "
            "or uninstall it")
        self.name, self.distribution = name, distribution


class ComponentUnavailable(TokenmillError):
    """A registered component cannot be used here (missing dependency, no GPU, ...)."""


class WorkerFailed(TokenmillError):
    """A worker of a multi-process engine died, hung past the collective timeout, or lost its
    connection: the engine cannot run another step, and every request in flight fails."""


class DeviceFailed(WorkerFailed):
    """The device raised an error that leaves it unusable (a CUDA illegal address poisons the
    process's context: every later CUDA call fails). The engine stops as for a dead worker,
    and ``tokenmill serve`` exits so that a supervisor can start a fresh process."""


class RankCallFailed(TokenmillError):
    """A control call (collective_rpc, a weight update, sleep) raised on one rank: the
    message names the rank and its error. The engine serves on."""

    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error

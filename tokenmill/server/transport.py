"""How uvicorn serves the app: TLS (vLLM's ``--ssl-*`` flags) and the proxy prefix.

Files are checked before uvicorn starts, so a missing key or certificate is one clear
ConfigError naming the setting, not a traceback from inside ``ssl``.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from tokenmill.core.config.server_config import ServerConfig
from tokenmill.interfaces.errors import ConfigError

_FILES = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` / ``uvicorn.run`` beyond host and port."""
    options: dict[str, Any] = {"root_path": config.root_path}
    for name in _FILES:
        value = getattr(config, name)
        if value is None:
            continue
        path = Path(value)
        try:
            path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"server.{name}", f"cannot read {value!r}: {exc.strerror or exc}") from None
        options[name] = str(path)
    if (config.ssl_keyfile is None) != (config.ssl_certfile is None):
        raise ConfigError("server.ssl_certfile", "https needs both ssl_keyfile and ssl_certfile")
    if config.ssl_keyfile is None and (config.ssl_ca_certs is not None or config.ssl_cert_reqs):
        raise ConfigError("server.ssl_ca_certs", "client certificates need https: set ssl_keyfile and ssl_certfile")
    if config.ssl_cert_reqs and config.ssl_ca_certs is None:
        raise ConfigError("server.ssl_ca_certs", "checking client certificates (ssl_cert_reqs) needs a CA bundle")
    if config.ssl_keyfile is not None:
        try:  # a key that does not match its certificate, or a file that is not PEM
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.ssl_certfile,
                                                                                config.ssl_keyfile)
        except ssl.SSLError as exc:
            raise ConfigError("server.ssl_certfile", f"the certificate and key cannot be used: {exc}") from None
        options["ssl_cert_reqs"] = config.ssl_cert_reqs
    return options


def scheme(config: ServerConfig) -> str:
    return "https" if config.ssl_keyfile is not None else "http"

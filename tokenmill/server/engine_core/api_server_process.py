"""One of the HTTP server processes of ``tokenmill serve --api-server-count N``.

Started by ``api_servers`` with a socket bound to the port (SO_REUSEPORT, beside the other
servers'; uvicorn listens on it once the engine is ready), its end of a socket pair to the
engine-core process, and a lifeline: the read end
of a pipe that only the parent writes, which reads end-of-file when the parent is gone. The
server then stops as on SIGTERM, so that a parent killed outright leaves no server behind.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection

import msgspec
import structlog

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.interfaces.errors import ConfigError
from tokenmill.server.logging import configure_logging
from tokenmill.server.transport import uvicorn_options

#: the environment variable the process's ApiServerSpec arrives in
SPEC_ENV = "TOKENMILL_API_SERVER"


class ApiServerSpec(msgspec.Struct, frozen=True):
    """What an API server process is started with (JSON, in its environment)."""

    config_json: str
    #: which of the servers this is (0 reports a failed engine build; the others exit quietly)
    index: int
    #: the name the engine's metrics carry (the first served model name)
    model_name: str
    listen_fd: int
    core_fd: int
    lifeline_fd: int


def watch_lifeline(fd: int) -> None:
    """SIGTERM to this process once the parent is gone (the pipe's write end closed)."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tokenmill-lifeline", daemon=True).start()


def main() -> int:
    # a terminal's Ctrl-C reaches the whole group: the parent answers it with one SIGTERM to
    # each server (uvicorn catches both once serving; before, SIGTERM ends a server quietly)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.json.decode(os.environ.pop(SPEC_ENV), type=ApiServerSpec)
    config = EngineConfig.model_validate_json(spec.config_json)
    configure_logging(config.server.log_level, config.server.log_format)
    structlog.contextvars.bind_contextvars(api_server=spec.index)
    watch_lifeline(spec.lifeline_fd)
    listener = socket.socket(fileno=spec.listen_fd)
    transport = uvicorn_options(config.server)  # before the engine is ready: the TLS files the parent checked
    from tokenmill.server.api_server import run_api_server
    from tokenmill.server.engine_core.client import EngineCoreClient

    try:
        served = EngineCoreClient(config, spec.model_name, config.server.max_queued_requests,
                                  Connection(spec.core_fd))
    except (ConfigError, RuntimeError) as exc:  # the engine's build failed: every server hears it, one says it
        if spec.index == 0:
            print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return run_api_server(served, config, transport, [listener])


if __name__ == "__main__":
    sys.exit(main())

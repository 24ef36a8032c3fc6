"""One HTTP server: the OpenAI app over an engine, run by uvicorn until it stops.

``tokenmill serve`` runs one in its own process; with ``--api-server-count N`` each of N
processes runs one over the same engine-core process (``engine_core.api_servers``), on a
listening socket it was handed.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

import uvicorn

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.server.app import create_app


def run_api_server(served: AsyncLLM | EmbeddingEngine, config: EngineConfig, transport: dict[str, Any],
                   sockets: Optional[list[socket.socket]] = None) -> int:
    """Serve until a signal or the engine's failure stops the server (1 for the latter:
    a supervisor then starts a fresh process); on ``sockets`` where given, else on the
    configured host and port. ``transport``: ``uvicorn_options``' (the caller's, checked
    before its engine was built)."""
    server: Optional[uvicorn.Server] = None

    def exit_server() -> None:  # the engine stopped on an error: a supervisor starts a fresh process
        server.should_exit = True

    app = create_app(served, config.server, on_engine_stopped=exit_server)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port,
        log_level=config.server.uvicorn_log_level or config.server.log_level,
        access_log=config.server.log_level == "debug",
        timeout_graceful_shutdown=int(config.server.drain_timeout) + 1, **transport))
    server.run(sockets)
    return 1 if getattr(served, "error", None) is not None else 0

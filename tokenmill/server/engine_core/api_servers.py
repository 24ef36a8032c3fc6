"""``tokenmill serve --api-server-count N``: N HTTP server processes in front of one
engine-core process, as vLLM's API servers share its engine core.

Why: with the engine in a process of its own, one server's event loop still does every
streamed token's work (a response chunk, its JSON, a socket write) on one core, some tens of
microseconds a token: at 64 streams on an H200 that held the engine to about a third of its
offline throughput (benchmarks/README.md, session 45). N servers share that work.

This process binds the port N times with SO_REUSEPORT, so that the kernel spreads new
connections across the servers by their addresses (with one shared socket the spread would
be whichever server accepts first). It starts the engine core with a socket pair per
server, then the servers, each handed its socket on the port, its end of a pair and a
lifeline (``api_server_process``). Then it supervises:
- SIGINT or SIGTERM (once, to this process alone or to the whole group) drains the servers:
  each finishes its streams and says so to the engine core, which ends when all have;
- a server that exits on its own takes the others down the same way (status 1: a
  supervisor restarts the whole); an engine core that exits ends every server, whose
  requests fail with its reason, as with one server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import msgspec
import structlog

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.interfaces.errors import ConfigError
from tokenmill.server.app import default_model_names
from tokenmill.server.engine_core.api_server_process import SPEC_ENV, ApiServerSpec
from tokenmill.server.engine_core.client import core_environment, start_core_process

log = structlog.get_logger("tokenmill.serve")

#: seconds the engine core and the servers get to stop on their own before they are killed
STOP_GRACE = 30.0


def bound_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets bound to (host, port) with SO_REUSEPORT, for the servers to listen on
    once they serve (until then a client is refused, as by one server that is starting). The
    port is first bound without it: a port in use, even by another process's SO_REUSEPORT
    sockets (which would otherwise share its connections with ours), fails here, as one
    server's bind would."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError("server.port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        port = probe.getsockname()[1]
    sockets = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sockets.append(sock)
    return sockets


def serve_api_servers(config: EngineConfig) -> int:
    """Run the engine core and ``config.server.api_server_count`` servers until stopped; the
    status ``tokenmill serve`` exits with (0 once drained on a signal, a failed process's
    else)."""
    count = config.server.api_server_count
    model_name = (config.server.served_model_name or default_model_names(str(config.model)))[0]
    listeners = bound_sockets(config.server.host, config.server.port, count)
    port = listeners[0].getsockname()[1]
    pairs = [socket.socketpair() for _ in range(count)]
    core = start_core_process(config, model_name, [theirs for _, theirs in pairs])
    lifeline, keep_alive = os.pipe()
    config_json = config.model_dump_json()
    servers = []
    for index, (listener, (ours, _)) in enumerate(zip(listeners, pairs)):
        spec = ApiServerSpec(config_json, index, model_name, listener.fileno(), ours.fileno(), lifeline)
        servers.append(subprocess.Popen(
            [sys.executable, "-P", "-m", "tokenmill.server.engine_core.api_server_process"],
            env={**core_environment(), SPEC_ENV: msgspec.json.encode(spec).decode()},
            pass_fds=(listener.fileno(), ours.fileno(), lifeline), stdin=subprocess.DEVNULL))
        listener.close()
        ours.close()
    os.close(lifeline)
    log.info("API servers started", count=count, port=port, engine_core=core.pid,
             servers=[server.pid for server in servers])
    stopping: list[int] = []
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda received, frame: stopping.append(received))
    try:
        failed = _supervise(core, servers, stopping)
        _stop(core, servers, config.server.drain_timeout, signal_servers=failed is not core)
    finally:
        os.close(keep_alive)
    if failed is None:
        return 0
    code = failed.returncode
    log.error("a server process exited; the others stop too", pid=failed.pid, code=code,
              engine_core=failed is core)
    return code if code in (1, 2) else 1


def _supervise(core: subprocess.Popen, servers: list[subprocess.Popen], stopping: list[int]
               ) -> Optional[subprocess.Popen]:
    """Wait for a stop signal (None) or for a process that exits on its own (it)."""
    while not stopping:
        for process in [core, *servers]:
            if process.poll() is not None:
                return None if stopping else process  # a group's signal ends a server as it reaches us
        time.sleep(0.1)
    return None


def _stop(core: subprocess.Popen, servers: list[subprocess.Popen], drain_timeout: float,
          signal_servers: bool) -> None:
    """SIGTERM to the servers (each drains, then tells the engine core), unless the engine
    core ended first (each server then ends on its own, its build's error or its requests'
    failure said); then wait for every process, killing what outlives its grace."""
    if signal_servers:
        for server in servers:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout + STOP_GRACE
    for process in [*servers, core]:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("a process did not stop; killing it", pid=process.pid)
            process.kill()
            process.wait()

"""A real uvicorn server on 127.0.0.1 in a background thread, or a real ``tokenmill serve``
process, for tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx

import uvicorn

from tokenmill import LLM, load_config
from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.core.config.server_config import ServerConfig
from tokenmill.core.engine.embedding_engine import EmbeddingEngine
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.server.app import create_app
from tokenmill.server.transport import scheme, uvicorn_options


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: the two ways ``tokenmill serve`` runs a generation engine: on a thread of the server's
#: process, or in a process of its own (--engine-process)
ENGINE_MODES = ("in-process", "engine-process")


@contextmanager
def served_engine(mode: str, model: str, **engine_args) -> Iterator[AsyncLLM]:
    """An AsyncLLM over ``model`` as ``mode`` serves it (``load_config``'s flat names)."""
    from tokenmill.server.engine_core.client import EngineCoreClient

    config = load_config(model=model, **engine_args)
    llm = AsyncLLM(LLM(config=config).llm_engine) if mode == "in-process" else EngineCoreClient(config, "m")
    try:
        yield llm
    finally:
        llm.shutdown(1.0)


@contextmanager
def running_server(engine: LLMEngine | EmbeddingEngine | AsyncLLM, **server_config) -> Iterator[tuple[str, AsyncLLM]]:
    """Yield (base_url, served object) while a uvicorn server serves ``engine``."""
    config = ServerConfig(**server_config)
    llm = AsyncLLM(engine, config.max_queued_requests) if isinstance(engine, LLMEngine) else engine
    app = create_app(llm, config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2, **uvicorn_options(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"{scheme(config)}://127.0.0.1:{port}", llm
    finally:
        server.should_exit = True
        thread.join(15)


def wait_until_healthy(port: int, timeout: float = 120, process: subprocess.Popen | None = None) -> None:
    """Poll a starting server's /health until it answers 200. A server that is not healthy
    within ``timeout``, or whose ``process`` exits first (an engine that failed to build),
    raises at once with what it wrote, rather than leaving the test to hang on its port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            _, err = process.communicate()
            raise RuntimeError(f"the server exited with status {process.returncode} before it was healthy:\n"
                               f"{(err or '')[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server on port {port} was not healthy within {timeout} s")


@contextmanager
def serve_process(*flags: str, timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """Yield (the process, base_url) of ``tokenmill serve FLAGS`` on a free port, once healthy;
    stopped (if still running) on the way out, its stderr in ``process.stderr_text``."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, timeout, process)
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.terminate()
        _, process.stderr_text = process.communicate(timeout=60)

"""EngineCoreClient: AsyncLLM's caller side over an engine in its own process.

The routes use it as they use an AsyncLLM: ``generate`` admits a request (checked and
tokenized here first) and returns its stream, closing a stream aborts its request. What
AsyncLLM's engine thread did, stepping, runs in the engine-core process
(``core_process.py``); in its place a thread here reads that process's messages and hands
each step's outputs to their streams. What the control routes ask of the engine between its
steps (runtime LoRA, the training-loop API, pooling, pausing) goes across as a named call
(``engine_calls``) whose answer settles its caller's future; code itself never crosses, so
``run_on_engine`` is refused. With several API servers (``api_servers``) each holds one of
these, attached to the engine-core process its parent started.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import msgspec
import structlog

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.engine.async_llm import AsyncLLM, settle_future
from tokenmill.core.engine.generation_pause import check_pause_mode
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.loop_commands import AbortRequest, AddRequest
from tokenmill.interfaces.errors import ConfigError, InvalidRequest, TokenmillError
from tokenmill.server.engine_core.core_process import SPEC_ENV
from tokenmill.server.engine_core.frontend import EngineFrontend, LoadedAdapters
from tokenmill.server.engine_core.messages import (
    Abort,
    Add,
    Call,
    CallDone,
    CoreSpec,
    EngineState,
    Outputs,
    Ready,
    Refused,
    Shutdown,
    StartFailed,
    StateSeen,
    Stopped,
    decode_from_core,
    encode,
    raised,
    request_output,
    tensor_of,
)

log = structlog.get_logger("tokenmill.engine_core")


class EngineCoreFailed(TokenmillError):
    """The engine-core process stopped: its loop's error (as that process wrote it), or its
    exit status. Shown as it is, so /health and the failed requests read as they would with
    the engine in this process."""

    def __repr__(self) -> str:
        return str(self)


class EngineCoreClient(AsyncLLM):
    def __init__(self, config: EngineConfig, model_name: str, max_queued_requests: Optional[int] = None,
                 connection: Optional[Connection] = None) -> None:
        """Start the engine-core process, or attach to one already started over
        ``connection`` (one of several API servers: ``api_servers``), and wait until its
        engine is built (a start's compiles take a while, and it logs as it goes). A build
        that fails raises its error here: a ConfigError where the config was at fault."""
        self.process: Optional[subprocess.Popen] = None
        if connection is None:
            ours, theirs = socket.socketpair()
            self.process = start_core_process(config, model_name, [theirs])
            connection = Connection(ours.detach())
        self.connection = connection
        try:
            frontend = EngineFrontend(config)  # while the engine builds
            ready = self._wait_ready()
        except BaseException:
            if self.process is not None:
                self.process.kill()
                self.process.wait()
            self.connection.close()
            raise
        frontend.adapters = LoadedAdapters(ready.adapters) if config.adapters.enable_lora else None
        log.info("engine core started", pid=ready.pid)
        self._send_lock = threading.Lock()
        #: request id -> its prompt (text, token ids), from its first output until its last
        self._prompts: dict[str, tuple[Optional[str], list[int]]] = {}
        self._counts = (0, 0)
        self._sent = 0
        self._taken = 0
        self._calls = itertools.count()
        #: call id -> the (loop, future) of its caller, until its CallDone
        self._awaited: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._is_paused = False
        super().__init__(frontend, max_queued_requests)  # type: ignore[arg-type]

    def _wait_ready(self) -> Ready:
        try:
            message = decode_from_core(self.connection.recv_bytes())
        except EOFError:
            raise RuntimeError(f"the engine-core process exited{self._exit_code()} before its engine was built; "
                               "its log above says why") from None
        if isinstance(message, StartFailed):
            if self.process is not None:
                self.process.wait()
            if message.field is not None:
                raise ConfigError(message.field, message.message.removeprefix(f"{message.field}: "))
            raise RuntimeError(f"the engine could not be built: {message.message}")
        assert isinstance(message, Ready), message
        return message

    def _exit_code(self) -> str:
        """`` (code N)`` where this server started the engine process, for its messages."""
        return f" (code {self.process.wait()})" if self.process is not None else ""

    # --- caller side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._counts[0] + max(0, self._sent - self._taken)

    @property
    def num_running(self) -> int:
        return self._counts[1]

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus text (its metrics are observed where its steps run)."""
        return await self._call("metrics_text", {})

    async def call(self, name: str, **kwargs: Any) -> Any:
        return await self._call(name, kwargs)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        check_pause_mode(mode)
        await self._call("pause_generation", {"mode": mode, "clear_cache": clear_cache})

    async def resume_generation(self) -> None:
        await self._call("resume_generation", {})

    def is_paused(self) -> bool:
        """As the engine's last EngineState said: a pause or resume asked of any API server."""
        return self._is_paused

    async def run_on_engine(self, fn: Callable[[LLMEngine], object]) -> object:
        raise InvalidRequest(None, "code does not cross to an engine in a process of its own (--engine-process): "
                                   "name an engine call instead (tokenmill.core.engine.engine_calls)")

    async def _call(self, name: str, kwargs: dict[str, Any]) -> Any:
        """Send a call and await its CallDone: its result, or its error raised."""
        call_id = next(self._calls)
        try:
            data = encode(Call(call_id, name, kwargs))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # JSON's integers have no bound
            raise InvalidRequest(None, f"the call's arguments cannot be sent to the engine process: {exc}") from None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._stopped:
                raise self._ended()
            self._awaited[call_id] = (loop, future)
        self._write_bytes(data)
        return await future

    def _send(self, command: object) -> None:
        if isinstance(command, AddRequest):
            prompt = command.prompt
            with self._lock:
                self._pending_adds -= 1  # counted in num_waiting by _sent instead
            params = command.params
            if params.structured_outputs is not None:  # without the constraint this process compiled
                params = replace(params, structured_outputs=replace(params.structured_outputs))
            try:
                data = encode(Add(command.request_id, prompt.get("prompt"), prompt["prompt_token_ids"],
                                  prompt.get("cache_salt"), params, command.priority, command.user,
                                  command.arrival_time, command.adapter_name))
            except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # JSON's integers have no bound
                self._deliver(command.request_id, InvalidRequest(None, f"the request's parameters cannot be "
                                                                       f"sent to the engine process: {exc}"), True)
                return
            with self._lock:
                self._sent += 1
            self._write_bytes(data)
        elif isinstance(command, AbortRequest):
            with self._lock:
                self._streams.pop(command.request_id, None)
                self._prompts.pop(command.request_id, None)
            self._write(Abort(command.request_id))

    def _write(self, message: msgspec.Struct) -> None:
        self._write_bytes(encode(message))

    def _write_bytes(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self.connection.send_bytes(data)
        except OSError:  # the engine process is gone: the reader thread fails every stream
            pass

    def shutdown(self, drain_timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to ``drain_timeout`` seconds, then stop the
        engine process (and fail whatever still runs)."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._write(Shutdown())
        if self.process is not None:
            try:
                self.process.wait(30.0)
            except subprocess.TimeoutExpired:
                log.warning("the engine-core process did not stop; killing it", pid=self.process.pid)
                self.process.kill()
                self.process.wait()
        self._thread.join(10.0)
        self.connection.close()

    # --- reader thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    message = decode_from_core(self.connection.recv_bytes())
                except (EOFError, OSError):
                    if not self._draining:
                        self.error = EngineCoreFailed(f"the engine-core process exited{self._exit_code()}")
                    return
                if isinstance(message, Outputs):
                    self._counts = (message.num_waiting, message.num_running)
                    self._taken = message.num_taken
                    self._deliver_step(self._outputs(message))
                elif isinstance(message, Refused):
                    self._taken = message.num_taken
                    self._deliver(message.request_id, raised(message.error, message.request_id), final=True)
                elif isinstance(message, CallDone):
                    self._settle_call(message)
                elif isinstance(message, EngineState):
                    self._is_paused = message.paused
                    if self.engine.adapters is not None:  # the routes' view of the adapters
                        self.engine.adapters = LoadedAdapters(message.adapters)
                    self._write(StateSeen(message.version))
                elif isinstance(message, Stopped):
                    self.error = EngineCoreFailed(message.error)
                    return
        except BaseException as exc:  # the reader must never die silently
            self.error = exc
            log.exception("reading the engine process failed")
            if self.process is not None:
                self.process.kill()
        finally:
            ended = self._ended()
            with self._lock:
                self._stopped = True
                awaited, self._awaited = self._awaited, {}
            self._fail_all(ended)
            for loop, future in awaited.values():
                if not loop.is_closed():
                    loop.call_soon_threadsafe(settle_future, future, None, ended)

    def _outputs(self, message: Outputs) -> list:
        prompts = self._prompts
        outputs = []
        for wire in message.outputs:
            request_id = wire.request_id
            if wire.prompt_token_ids is not None:
                prompt = (wire.prompt, wire.prompt_token_ids)
                if not wire.finished:
                    with self._lock:  # kept only while its stream is (an abort drops both, under the lock)
                        if request_id in self._streams:
                            prompts[request_id] = prompt
            else:
                prompt = prompts.pop(request_id, None) if wire.finished else prompts.get(request_id)
                if prompt is None:  # aborted here after the engine sent it
                    continue
            outputs.append(request_output(wire, *prompt))
        return outputs

    def _settle_call(self, message: CallDone) -> None:
        with self._lock:
            target = self._awaited.pop(message.call_id, None)
        if target is None or target[0].is_closed():
            return
        if message.error is not None:
            result, error = None, raised(message.error)
        else:
            result, error = tensor_of(message.tensor) if message.tensor is not None else message.result, None
        target[0].call_soon_threadsafe(settle_future, target[1], result, error)


def start_core_process(config: EngineConfig, model_name: str, ends: list[socket.socket]) -> subprocess.Popen:
    """The engine-core process, given its ends of the socket pairs, one per API server
    (closed here once it has them)."""
    fds = [end.fileno() for end in ends]
    spec = CoreSpec(config.model_dump_json(), fds, model_name, config.server.log_requests, config.server.log_level,
                    config.server.log_format)
    # -P: the working directory does not shadow installed packages (as the workers start)
    process = subprocess.Popen([sys.executable, "-P", "-m", "tokenmill.server.engine_core.core_process"],
                               env={**core_environment(), SPEC_ENV: msgspec.json.encode(spec).decode()},
                               pass_fds=fds, stdin=subprocess.DEVNULL)
    for end in ends:
        end.close()
    return process


def core_environment() -> dict[str, str]:
    """The engine process's environment: the server's, with OpenMP's idle threads waiting
    passively between parallel regions unless the user chose otherwise. The engine steps on
    its process's main thread, where OpenMP (libgomp) lets idle threads spin for a while; the
    server's work for each streamed token then competes with a spinning thread for a core
    (benchmarks/README.md, session 42)."""
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env

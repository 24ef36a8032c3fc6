"""The engine-core process: an LLMEngine's step loop, fed and read over a socket.

``tokenmill serve --engine-process`` runs the engine here and the HTTP server in the process
that started it, as vLLM runs its EngineCore beside its API server. Each has a GIL of its
own: the event loop's work per streamed token (a response chunk, a socket write) no longer
waits for the engine's, nor the engine's for it.

A thread reads the server's messages into a queue; the main thread admits, aborts and runs
calls between steps (the named engine calls of ``engine_calls``, and pausing as an in-process
engine's thread pauses: ``generation_pause``), steps, and sends each step's outputs. Metrics
and request logs are observed here, where the steps are, and the server asks for the
Prometheus text when it is scraped.
The process ends when the server says so, or when its socket closes: a server that died
leaves no engine behind. It ignores SIGINT and SIGTERM, which a terminal or a supervisor may
send to the whole process group, so that the server's drain still has its engine.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import structlog
import torch
from prometheus_client import generate_latest

from tokenmill.core.engine.async_llm import StepObserver, observe_step
from tokenmill.core.engine.engine_calls import run_call
from tokenmill.core.engine.generation_pause import GenerationPause
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.metrics import EngineMetrics
from tokenmill.core.engine.step_isolation import raise_if_fatal
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.types import RequestOutput
from tokenmill.server.engine_core.messages import (
    Abort,
    Add,
    Call,
    CallDone,
    CoreSpec,
    Outputs,
    Ready,
    Refused,
    Shutdown,
    StartFailed,
    Stopped,
    decode_to_core,
    encode,
    wire_error,
    wire_output,
    wire_tensor,
)
from tokenmill.server.logging import configure_logging, log_finished_requests

log = structlog.get_logger("tokenmill.engine_core")

#: the environment variable the process's CoreSpec arrives in
SPEC_ENV = "TOKENMILL_ENGINE_CORE"


class EngineCore:
    """The loop: one writer (this thread) and one reader thread on the connection."""

    def __init__(self, engine: LLMEngine, connection: Connection, metrics: EngineMetrics, log_requests: bool) -> None:
        self.engine = engine
        self.connection = connection
        self.metrics = metrics
        self.observers: list[StepObserver] = [metrics.observe_step] + ([log_finished_requests] if log_requests else [])
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        #: requests that have had an output sent: their prompt went with the first
        self._started: set[str] = set()
        #: requests whose constraint compiles on the manager's thread, admitted once it has:
        #: a slow compile delays its own request, not every step
        self._compiling: dict[str, tuple[Add, Future]] = {}
        self._pause: GenerationPause[int, Add] = GenerationPause(engine)
        #: the Adds admitted, refused or aborted before either so far (held and compiling ones
        #: are still on their way)
        self._taken = 0
        self._counts = (0, 0, 0)
        threading.Thread(target=self._read, name="tokenmill-core-reader", daemon=True).start()

    def run(self) -> None:
        """Serve until told to stop; an error in the engine's own bookkeeping propagates."""
        engine = self.engine
        while self._drain():
            for call_id in self._pause.settle():
                self._done(call_id, True)  # paused
            if self._pause.paused or not engine.has_unfinished_requests():  # a compile that ends wakes it too
                self._send_outputs([])  # the server's counts, where a call or an abort changed them
                engine.check_health()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            outputs = engine.step()
            self._observe(outputs)
            self._send_outputs(outputs)

    def _read(self) -> None:
        try:
            while True:
                message = decode_to_core(self.connection.recv_bytes())
                self._commands.put(message)
                self._wake.set()
                if isinstance(message, Shutdown):
                    return
        except (EOFError, OSError):  # the server is gone
            self._commands.put(Shutdown())
            self._wake.set()

    def _drain(self) -> bool:
        """Apply the queued commands; False once told to stop."""
        if self._compiling:  # a step's drain scans nothing when no constraint is compiling
            for add, compiled in [entry for entry in self._compiling.values() if entry[1].done()]:
                del self._compiling[add.request_id]
                self._add(add)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, Add):
                self._admit(command)
            elif isinstance(command, Abort):
                self._abort(command.request_id)
            elif isinstance(command, Call):
                self._call(command)
            else:
                return False

    def _abort(self, request_id: str) -> None:
        """End a request wherever it is: compiling, held by a pause, or in the engine."""
        self._started.discard(request_id)
        held = self._pause.held
        if self._compiling.pop(request_id, None) is not None:
            self._taken += 1  # never added: no longer on its way, for the server's count
        elif any(add.request_id == request_id for add in held):
            held[:] = [add for add in held if add.request_id != request_id]
            self._taken += 1
        else:
            self._observe(self.engine.abort_request(request_id))

    def _admit(self, add: Add) -> None:
        constraint, manager = add.params.structured_outputs, self.engine.structured_outputs
        if constraint is not None and manager is not None:
            compiled = manager.compile_async(constraint)
            if not compiled.done():
                self._compiling[add.request_id] = (add, compiled)
                compiled.add_done_callback(lambda _: self._wake.set())
                return
        self._add(add)

    def _add(self, add: Add) -> None:
        """Admit a request whose constraint, if any, has compiled (or failed to: admission
        then refuses it with the reason). While generation is paused it is held."""
        if self._pause.holds:
            self._pause.held.append(add)
            return
        self._taken += 1
        prompt = {"prompt": add.prompt, "prompt_token_ids": add.prompt_token_ids}
        if add.cache_salt is not None:
            prompt["cache_salt"] = add.cache_salt
        try:
            self.engine.add_request(add.request_id, prompt, add.params, priority=add.priority, user=add.user,
                                    arrival_time=add.arrival_time, adapter_name=add.adapter_name)
        except Exception as exc:  # a bug met by this request alone: it fails, the loop goes on
            error = wire_error(exc)
            if error.kind not in ("invalid", "asleep"):
                log.error("adding a request failed", request_id=add.request_id, exc_info=exc)
            self._send(Refused(add.request_id, error, self._taken))

    def _call(self, call: Call) -> None:
        """A call's answer goes back now, or (a pause that waits) when it takes effect."""
        if call.name == "pause_generation":
            aborted = self._pause.pause(call.kwargs["mode"], call.kwargs["clear_cache"], call.call_id)
            self._observe(aborted)
            self._send_outputs(aborted)
        elif call.name == "resume_generation":
            held, waiters = self._pause.resume()
            for add in held:
                self._add(add)
            for call_id in waiters + [call.call_id]:
                self._done(call_id, False)  # not paused: a pause still waiting is over
        elif call.name == "metrics_text":
            self._done(call.call_id, generate_latest(self.metrics.registry))
        else:
            try:
                result = run_call(self.engine, call.name, call.kwargs)
            except Exception as exc:  # the caller's error; a device fault then stops the loop
                self._send(CallDone(call.call_id, error=wire_error(exc)))
                raise_if_fatal(self.engine.platform, exc)
                return
            self._done(call.call_id, result)

    def _done(self, call_id: int, result: Any) -> None:
        if isinstance(result, torch.Tensor):
            done = CallDone(call_id, tensor=wire_tensor(result))
        else:
            done = CallDone(call_id, result)
        try:
            data = encode(done)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # a worker extension's result
            data = encode(CallDone(call_id, error=wire_error(TypeError(f"the result cannot be sent to the server: "
                                                                         f"{exc}"))))
        self.connection.send_bytes(data)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        observe_step(self.observers, self.engine, outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        scheduler = self.engine.scheduler
        counts = (len(scheduler.waiting), len(scheduler.running), self._taken)
        if not outputs and counts == self._counts:
            return
        self._counts = counts
        started = self._started
        wire = []
        for output in outputs:
            request_id = output.request_id
            wire.append(wire_output(output, request_id not in started))
            if output.finished:
                started.discard(request_id)
            else:
                started.add(request_id)
        self._send(Outputs(wire, *counts))

    def _send(self, message: msgspec.Struct) -> None:
        self.connection.send_bytes(encode(message))


def main() -> int:
    # Ctrl-C, and a supervisor's SIGTERM, may reach the whole process group: the server drains
    # its requests and then stops this process, and if the server dies its socket closes
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    spec = msgspec.json.decode(os.environ.pop(SPEC_ENV), type=CoreSpec)
    connection = Connection(spec.fd)
    configure_logging(spec.log_level, spec.log_format)
    from tokenmill.core.config.engine_config import EngineConfig
    from tokenmill.core.engine.builder import build_engine

    try:
        engine = build_engine(EngineConfig.model_validate_json(spec.config_json))
        if not isinstance(engine, LLMEngine):  # an encoder: one process, nothing to shut down
            raise ConfigError("engine_process", "an embedding model is served from one process: "
                                                "drop --engine-process")
    except ConfigError as exc:
        connection.send_bytes(encode(StartFailed(str(exc), exc.key)))
        return 2
    except Exception as exc:
        log.exception("the engine could not be built")
        connection.send_bytes(encode(StartFailed(repr(exc))))
        return 1
    core = EngineCore(engine, connection, EngineMetrics(spec.model_name), spec.log_requests)
    connection.send_bytes(encode(Ready(os.getpid(), dict(engine.adapters.loaded()) if engine.adapters else {})))
    try:
        core.run()
    except BaseException as exc:  # the loop must never die silently
        log.exception("engine loop failed")
        try:
            connection.send_bytes(encode(Stopped(repr(exc))))
        except OSError:
            pass
        return 1
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

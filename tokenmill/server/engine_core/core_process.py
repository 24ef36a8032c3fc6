"""The engine-core process: an LLMEngine's step loop, fed and read over a socket.

``tokenmill serve --engine-process`` runs the engine here and the HTTP server in the process
that started it, as vLLM runs its EngineCore beside its API server. Each has a GIL of its
own: the event loop's work per streamed token (a response chunk, a socket write) no longer
waits for the engine's, nor the engine's for it.

With ``--api-server-count N`` it serves N HTTP server processes, a connection each
(``api_servers``): each server's requests, answers and counts go back on its own connection.

A thread per connection reads its server's messages into one queue; the main thread admits,
aborts and runs calls between steps (the named engine calls of ``engine_calls``, and pausing
as an in-process engine's thread pauses: ``generation_pause``), steps, and sends each step's
outputs. Metrics and request logs are observed here, where the steps are, and a server asks
for the Prometheus text when it is scraped.
The process ends when every server has said so or its socket has closed: servers that died
leave no engine behind, and one that dies alone takes only its own requests with it. It
ignores SIGINT and SIGTERM, which a terminal or a supervisor may send to the whole process
group, so that the servers' drains still have their engine.
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
from tokenmill.interfaces.outputs import RequestOutput
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
    WireError,
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
    """The loop: one writer (this thread) and a reader thread per API server's connection."""

    def __init__(self, engine: LLMEngine, connections: list[Connection], metrics: EngineMetrics,
                 log_requests: bool) -> None:
        self.engine = engine
        self.connections = connections
        self.metrics = metrics
        self.observers: list[StepObserver] = [metrics.observe_step] + ([log_finished_requests] if log_requests else [])
        #: (API server, its message) in arrival order
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        #: the API servers still connected; the loop ends when none is
        self._open = set(range(len(connections)))
        #: request id -> the API server that sent it, until its last output or refusal
        self._owner: dict[str, int] = {}
        #: requests that have had an output sent: their prompt went with the first
        self._started: set[str] = set()
        #: requests whose constraint compiles on the manager's thread, admitted once it has:
        #: a slow compile delays its own request, not every step
        self._compiling: dict[str, tuple[Add, Future]] = {}
        #: a pause's waiter: (API server, call id)
        self._pause: GenerationPause[tuple[int, int], Add] = GenerationPause(engine)
        #: per API server, the Adds admitted, refused or aborted before either so far (held
        #: and compiling ones are still on their way)
        self._taken = [0] * len(connections)
        #: per API server, the (waiting, running, taken) it was last sent
        self._counts = [(0, 0, 0)] * len(connections)
        #: what the servers were last told (paused, adapters), its version, and the version
        #: each server has read
        self._state = self._engine_state()
        self._version = 0
        self._seen = [0] * len(connections)
        #: call answers held until every open server has read the state before them:
        #: (version, server, the CallDone's bytes)
        self._held_answers: list[tuple[int, int, bytes]] = []
        for client, connection in enumerate(connections):
            threading.Thread(target=self._read, args=(client, connection), name=f"tokenmill-core-reader-{client}",
                             daemon=True).start()

    def run(self) -> None:
        """Serve until every API server has gone; an error in the engine's own bookkeeping
        propagates."""
        engine = self.engine
        while self._drain():
            settled = self._pause.settle()
            if settled:
                self._share_state()
            for client, call_id in settled:
                self._done(client, call_id, True)  # paused
            if self._pause.paused or not engine.has_unfinished_requests():  # a compile that ends wakes it too
                self._send_outputs([])  # the servers' counts, where a call or an abort changed them
                engine.check_health()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            outputs = engine.step()
            self._observe(outputs)
            self._send_outputs(outputs)

    def _read(self, client: int, connection: Connection) -> None:
        try:
            while True:
                message = decode_to_core(connection.recv_bytes())
                self._commands.put((client, message))
                self._wake.set()
                if isinstance(message, Shutdown):
                    return
        except (EOFError, OSError):  # the server is gone
            self._commands.put((client, Shutdown()))
            self._wake.set()

    def _drain(self) -> bool:
        """Apply the queued commands; False once no API server is left."""
        if self._compiling:  # a step's drain scans nothing when no constraint is compiling
            for add, compiled in [entry for entry in self._compiling.values() if entry[1].done()]:
                del self._compiling[add.request_id]
                self._add(add)
        while True:
            try:
                client, command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, Add):
                self._admit(client, command)
            elif isinstance(command, Abort):
                if self._owner.get(command.request_id) == client:  # a server ends its own requests only
                    self._abort(command.request_id)
            elif isinstance(command, Call):
                self._call(client, command)
            elif isinstance(command, StateSeen):
                self._seen[client] = command.version
                self._release_answers()
            elif client in self._open:
                self._close(client)
                if not self._open:
                    return False

    def _close(self, client: int) -> None:
        """An API server has gone (its shutdown, which drained its streams first, or its
        death): whatever of its requests is left ends; the others go on. Closing its end
        lets the server's reader see the end of the engine's messages at once."""
        self._open.discard(client)
        for request_id in [request_id for request_id, owner in self._owner.items() if owner == client]:
            self._abort(request_id)
        self.connections[client].close()
        self._release_answers()  # it will read no more states

    def _abort(self, request_id: str) -> None:
        """End a request wherever it is: compiling, held by a pause, or in the engine. Its
        server has dropped its stream: the final output is observed, not sent."""
        self._started.discard(request_id)
        client = self._owner.pop(request_id, None)
        if client is None:  # it ended already: the abort crossed its last output
            return
        held = self._pause.held
        if self._compiling.pop(request_id, None) is not None:
            self._taken[client] += 1  # never added: no longer on its way, for the server's count
        elif any(add.request_id == request_id for add in held):
            held[:] = [add for add in held if add.request_id != request_id]
            self._taken[client] += 1
        else:
            self._observe(self.engine.abort_request(request_id))

    def _admit(self, client: int, add: Add) -> None:
        if add.request_id in self._owner:  # API servers draw their ids at random: never in practice
            self._taken[client] += 1
            self._send(client, Refused(add.request_id, WireError("invalid", f"request id {add.request_id!r} is "
                                                                            "already in use"), self._taken[client]))
            return
        self._owner[add.request_id] = client
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
        client = self._owner[add.request_id]
        self._taken[client] += 1
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
            del self._owner[add.request_id]
            self._send(client, Refused(add.request_id, error, self._taken[client]))

    def _call(self, client: int, call: Call) -> None:
        """A call's answer goes back now, or (a pause that waits) when it takes effect."""
        if call.name == "pause_generation":
            aborted = self._pause.pause(call.kwargs["mode"], call.kwargs["clear_cache"], (client, call.call_id))
            self._observe(aborted)
            self._send_outputs(aborted)
        elif call.name == "resume_generation":
            held, waiters = self._pause.resume()
            for add in held:
                self._add(add)
            self._share_state()
            for waiter in waiters + [(client, call.call_id)]:
                self._done(*waiter, False)  # not paused: a pause still waiting is over
        elif call.name == "metrics_text":
            self._done(client, call.call_id, generate_latest(self.metrics.registry))
        else:
            try:
                result = run_call(self.engine, call.name, call.kwargs)
            except Exception as exc:  # the caller's error; a device fault then stops the loop
                self._send(client, CallDone(call.call_id, error=wire_error(exc)))
                raise_if_fatal(self.engine.platform, exc)
                return
            self._share_state()
            self._done(client, call.call_id, result)

    def _engine_state(self) -> tuple[bool, dict[str, str]]:
        adapters = self.engine.adapters
        return self._pause.paused, dict(adapters.loaded()) if adapters is not None else {}

    def _share_state(self) -> None:
        """Tell every API server what changed of what its routes read: a pause or an
        adapter taken effect here, whichever server asked for it."""
        state = self._engine_state()
        if state != self._state:
            self._state = state
            self._version += 1
            data = encode(EngineState(*state, self._version))
            for client in list(self._open):
                self._send_bytes(client, data)

    def _done(self, client: int, call_id: int, result: Any) -> None:
        """A call's answer; held while some server has not read the latest state."""
        if isinstance(result, torch.Tensor):
            done = CallDone(call_id, tensor=wire_tensor(result))
        else:
            done = CallDone(call_id, result)
        try:
            data = encode(done)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # a worker extension's result
            data = encode(CallDone(call_id, error=wire_error(TypeError(f"the result cannot be sent to the server: "
                                                                         f"{exc}"))))
        self._held_answers.append((self._version, client, data))
        self._release_answers()

    def _release_answers(self) -> None:
        """Send the held answers whose state every open server has read."""
        if not self._held_answers:
            return
        seen = min((self._seen[client] for client in self._open), default=self._version)
        ready = [answer for answer in self._held_answers if answer[0] <= seen]
        self._held_answers = [answer for answer in self._held_answers if answer[0] > seen]
        for _, client, data in ready:
            self._send_bytes(client, data)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        observe_step(self.observers, self.engine, outputs)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """Each API server its requests' outputs of the step, and the queue's counts where
        they changed."""
        scheduler = self.engine.scheduler
        waiting, running = len(scheduler.waiting), len(scheduler.running)
        started, owner = self._started, self._owner
        wire: list[list] = [[] for _ in self.connections]
        for output in outputs:
            request_id = output.request_id
            client = owner.pop(request_id, None) if output.finished else owner.get(request_id)
            if client is not None:
                wire[client].append(wire_output(output, request_id not in started))
            if output.finished:
                started.discard(request_id)
            else:
                started.add(request_id)
        for client in list(self._open):
            counts = (waiting, running, self._taken[client])
            if wire[client] or counts != self._counts[client]:
                self._counts[client] = counts
                self._send(client, Outputs(wire[client], *counts))

    def _send(self, client: int, message: msgspec.Struct) -> None:
        self._send_bytes(client, encode(message))

    def _send_bytes(self, client: int, data: bytes) -> None:
        """To one API server; one that has gone is dropped when its reader says so."""
        try:
            self.connections[client].send_bytes(data)
        except OSError:
            pass


def main() -> int:
    # Ctrl-C, and a supervisor's SIGTERM, may reach the whole process group: the server drains
    # its requests and then stops this process, and if the server dies its socket closes
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    spec = msgspec.json.decode(os.environ.pop(SPEC_ENV), type=CoreSpec)
    connections = [Connection(fd) for fd in spec.fds]

    def tell_all(message: msgspec.Struct) -> None:
        for connection in connections:
            try:
                connection.send_bytes(encode(message))
            except OSError:  # that server is gone
                pass
    configure_logging(spec.log_level, spec.log_format)
    from tokenmill.core.config.engine_config import EngineConfig
    from tokenmill.core.engine.builder import build_engine

    try:
        engine = build_engine(EngineConfig.model_validate_json(spec.config_json))
        if not isinstance(engine, LLMEngine):  # an encoder: one process, nothing to shut down
            raise ConfigError("engine_process", "an embedding model is served from one process: "
                                                "drop --engine-process and --api-server-count")
    except ConfigError as exc:
        tell_all(StartFailed(str(exc), exc.key))
        return 2
    except Exception as exc:
        log.exception("the engine could not be built")
        tell_all(StartFailed(repr(exc)))
        return 1
    core = EngineCore(engine, connections, EngineMetrics(spec.model_name), spec.log_requests)
    tell_all(Ready(os.getpid(), dict(engine.adapters.loaded()) if engine.adapters else {}))
    try:
        core.run()
    except BaseException as exc:  # the loop must never die silently
        log.exception("engine loop failed")
        tell_all(Stopped(repr(exc)))
        return 1
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

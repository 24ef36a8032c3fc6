"""The driver's side of a multi-process model: start the ranks, shake hands, send each step.

Rank 0 lives in the engine's process. The others are started by the executor and connect
back over a socket authenticated with a per-engine key (``multiprocessing.connection``'s
HMAC challenge); messages on it are msgspec (messages.py), never pickle. Tensors go only
through torch.distributed, in the model's own collectives.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from datetime import timedelta
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Optional, Sequence

import msgspec
import structlog
import torch.distributed as dist

from tokenmill.core.distributed.messages import (
    PROTOCOL_VERSION,
    Failed,
    Hello,
    LoadAdapter,
    Ready,
    Reply,
    Result,
    Shutdown,
    Step,
    Swap,
    UnloadAdapter,
    WorkerSpec,
    decode_from_worker,
    encode,
)
from tokenmill.core.worker.model_step import ModelStep, StepResult
from tokenmill.interfaces.adapters import AdapterType
from tokenmill.interfaces.errors import ConfigError, InvalidRequest, WorkerFailed
from tokenmill.interfaces.executor import Executor, WorkerLaunch

log = structlog.get_logger("tokenmill.distributed")

#: how long a worker may take to connect, and to build its shard, before startup fails
STARTUP_TIMEOUT_S = 600.0
#: how long workers get to exit on shutdown before they are killed
SHUTDOWN_GRACE_S = 5.0
#: how long a connection may take to authenticate and say Hello (its plugins loaded)
HELLO_TIMEOUT_S = 120


def _clear_receive_timeout(connection: Connection) -> None:
    with socket.socket(fileno=os.dup(connection.fileno())) as sock:  # the same socket, through a second fd
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))


class WorkerGroup:
    """Ranks 1 .. world - 1, as the driver sees them."""

    def __init__(self, executor: Executor, config_json: str, tp: int, pp: int, timeout_s: float) -> None:
        self.executor = executor
        self.world_size = tp * pp
        self.timeout_s = timeout_s
        self._closed = False
        #: why the ranks are out of step (a control call that timed out), or None
        self.broken: Optional[str] = None
        self.connections: dict[int, Connection] = {}
        self.hellos: dict[int, Hello] = {}
        self._authkey = secrets.token_bytes(32)
        host = executor.driver_host()
        self._server = socket.create_server((host, 0))
        self._server.settimeout(1.0)
        try:
            #: the rendezvous of the torch.distributed groups (communicator.py), under a key-derived
            #: prefix: the store itself has no authentication, so its keys must not be guessable
            self.store = dist.PrefixStore(self._authkey[:8].hex(), dist.TCPStore(
                host, 0, self.world_size, is_master=True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                wait_for_workers=False))
            spec = WorkerSpec(PROTOCOL_VERSION, config_json, host, self._server.getsockname()[1],
                              self.store.underlying_store.port, self._authkey.hex(), tp, pp, timeout_s)
            executor.launch(WorkerLaunch(tuple(range(1, self.world_size)), msgspec.json.encode(spec).decode()))
            self._accept_all()
        except BaseException:
            self.shutdown()
            raise

    # --- startup ---------------------------------------------------------------
    def _accept_all(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self.hellos) < self.world_size - 1:
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"only {len(self.hellos)} of {self.world_size - 1} workers connected "
                                   f"within {STARTUP_TIMEOUT_S:.0f} s")
            try:
                sock, _ = self._server.accept()
            except socket.timeout:
                continue
            sock.setblocking(True)
            # a peer that connects and stays silent must not hold startup: reads time out
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(HELLO_TIMEOUT_S), 0))
            connection = Connection(sock.detach())
            try:
                deliver_challenge(connection, self._authkey)
                answer_challenge(connection, self._authkey)
                hello = decode_from_worker(connection.recv_bytes())
            except Exception as exc:  # a stranger, a wrong key, a timeout, garbage
                log.warning("refused a control connection", error=repr(exc))
                connection.close()
                continue
            _clear_receive_timeout(connection)
            if isinstance(hello, Failed):
                connection.close()
                raise WorkerFailed(f"a worker failed to start: {hello.error}")
            if not isinstance(hello, Hello) or hello.protocol != PROTOCOL_VERSION:
                connection.close()
                raise WorkerFailed(f"a worker speaks protocol {getattr(hello, 'protocol', '?')}, the driver "
                                   f"{PROTOCOL_VERSION}: install the same tokenmill on every machine")
            if not 0 < hello.rank < self.world_size or hello.rank in self.connections:
                connection.close()
                raise WorkerFailed(f"a worker says it is rank {hello.rank} (expected 1..{self.world_size - 1}, once)")
            self.connections[hello.rank] = connection
            self.hellos[hello.rank] = hello
        self._server.close()  # every rank is in: nobody else may connect

    def check_fingerprints(self, own: dict[str, list[str]], received: dict[int, dict[str, list[str]]]) -> None:
        """Every rank must have registered the same components as the driver."""
        for rank, theirs in sorted(received.items()):
            if theirs == own:
                continue
            lines = []
            for kind in sorted(set(own) | set(theirs)):
                only_driver = sorted(set(own.get(kind, [])) - set(theirs.get(kind, [])))
                only_worker = sorted(set(theirs.get(kind, [])) - set(own.get(kind, [])))
                if only_driver:
                    lines.append(f"{kind} registered only in the driver: {', '.join(only_driver)}")
                if only_worker:
                    lines.append(f"{kind} registered only in rank {rank}: {', '.join(only_worker)}")
            raise ConfigError("plugins", f"rank {rank} registered other components than the driver ("
                              + "; ".join(lines) + "). Every rank builds its plugin manager from the "
                              "'tokenmill.plugins' entry points: install a plugin as a package (with that "
                              "entry point) on every machine instead of registering it in one process")

    def wait_ready(self) -> list[Ready]:
        """Each worker's Ready once its shard is built (its Failed reason raised if not)."""
        ready = []
        for rank, connection in sorted(self.connections.items()):
            message = self._receive(rank, connection, STARTUP_TIMEOUT_S)
            if isinstance(message, Failed):
                raise WorkerFailed(f"rank {rank} failed to build its part of the model: {message.error}")
            if not isinstance(message, Ready):
                raise WorkerFailed(f"rank {rank} sent {type(message).__name__} instead of Ready")
            ready.append(message)
        return ready

    # --- running ---------------------------------------------------------------
    def send(self, message: msgspec.Struct) -> None:
        data = encode(message)
        for rank, connection in self.connections.items():
            try:
                connection.send_bytes(data)
            except OSError as exc:
                raise WorkerFailed(f"rank {rank} is unreachable: {exc}") from exc

    def request(self, message: msgspec.Struct) -> list[Optional[str]]:
        """Send ``message`` and collect every worker's Reply: its error or None."""
        self.send(message)
        errors = []
        for rank, connection in sorted(self.connections.items()):
            reply = self._receive(rank, connection, self.timeout_s)
            errors.append(reply.error if isinstance(reply, Reply) else f"unexpected {type(reply).__name__}")
        return errors

    def results(self, what: str, timeout_s: float) -> list[Result]:
        """Every worker's Result to the Control just sent, in rank order. A rank that does
        not answer in time leaves the group broken: its reply would come out of turn, and a
        rank busy elsewhere cannot step, so the engine stops."""
        results = []
        for rank, connection in sorted(self.connections.items()):
            try:
                reply = self._receive(rank, connection, timeout_s)
            except WorkerFailed as exc:
                if "did not answer" in str(exc):
                    self.broken = f"rank {rank} did not finish {what} within {timeout_s:g} s"
                    raise TimeoutError(self.broken + "; the engine stops, as that rank cannot step") from None
                raise
            results.append(reply if isinstance(reply, Result) else Result(error=f"unexpected {type(reply).__name__}"))
        return results

    def _receive(self, rank: int, connection: Connection, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not connection.poll(0.5):
            self._check_alive("")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"rank {rank} did not answer within {timeout_s:.0f} s")
        try:
            return decode_from_worker(connection.recv_bytes())
        except (OSError, EOFError) as exc:
            raise WorkerFailed(f"rank {rank} closed its control connection: {exc!r}") from exc

    def _check_alive(self, when: str) -> None:
        if self.broken is not None:
            raise WorkerFailed(self.broken)
        failed = self.executor.failed_workers()
        if failed:
            raise WorkerFailed("worker stopped" + (f" {when}" if when else "") + ": " + "; ".join(failed))

    def check_health(self) -> None:
        """Raise WorkerFailed if a worker is gone (the engine then stops: /health turns unhealthy)."""
        if not self._closed:
            self._check_alive("")

    def shutdown(self) -> None:
        """Ask every worker to exit, then have the executor make sure (kill after a grace)."""
        if self._closed:
            return
        self._closed = True
        for connection in self.connections.values():
            try:
                connection.send_bytes(encode(Shutdown()))
            except OSError:
                pass
        self.executor.shutdown(SHUTDOWN_GRACE_S)
        for connection in self.connections.values():
            connection.close()
        self._server.close()


class DistributedModelStep:
    """The driver's ModelStep under several ranks: each step goes to the workers first."""

    def __init__(self, local: ModelStep, group: WorkerGroup) -> None:
        self.local = local
        self.group = group
        #: steps run (benchmarks divide collective time by it)
        self.steps = 0

    @property
    def model(self):
        return self.local.model

    @property
    def greedy_head(self):
        return self.local.greedy_head

    @property
    def parallel(self):
        return self.local.parallel

    def run(self, step: Step, wait: bool = True, placeholders: None = None) -> Optional[StepResult]:
        """``placeholders``: none (async scheduling, which fills them, runs in one process only)."""
        if self.group.broken is not None:
            raise WorkerFailed(self.group.broken)
        self.group.send(step)
        self.steps += 1
        try:
            return self.local.run(step, wait)
        except WorkerFailed:
            raise
        except Exception as exc:  # the workers ran (or wait in) this step's collectives: out of step
            raise WorkerFailed(f"rank 0 failed in a step every rank runs: {type(exc).__name__}: {exc}") from exc

    def receive(self, step: Step) -> StepResult:
        return self.local.receive(step)

    def swap_blocks(self, out: Sequence[Sequence[int]], into: Sequence[Sequence[int]]) -> None:
        self.group.send(Swap(out, into))
        self.local.swap_blocks(out, into)


class DistributedAdapters:
    """The engine's view of the driver's adapters, with loads and unloads repeated on every
    worker (whose layers hold their own slices of each adapter). Each rank's ModelStep
    prepares its steps with its own adapters object."""

    def __init__(self, local: AdapterType, group: WorkerGroup) -> None:
        self.local = local
        self.group = group
        self.max_active = local.max_active

    @property
    def in_use(self):
        return self.local.in_use

    @in_use.setter
    def in_use(self, value) -> None:
        self.local.in_use = value

    def loaded(self) -> dict[str, str]:
        return self.local.loaded()

    def load(self, name: str, path: str) -> None:
        was_loaded = name in self.local.loaded()
        self.local.load(name, path)  # validates: a bad adapter is refused before any worker reads it
        errors = [e for e in self.group.request(LoadAdapter(name, path, sorted(self.local.loaded()))) if e]
        if errors:  # the ranks must agree: none keeps what one could not load
            self.group.request(UnloadAdapter(name))
            if not was_loaded:
                self.local.unload(name)
            raise InvalidRequest("lora_path", f"adapter {name!r} failed to load on a worker: {errors[0]}")

    def unload(self, name: str) -> None:
        self.local.unload(name)
        self.group.request(UnloadAdapter(name))

"""The driver-worker control protocol: explicit, versioned msgspec messages, never pickle.

A worker says ``Hello`` (the protocol version it speaks, its registries' fingerprint) as
soon as it has read its plugins, and ``Ready`` (its KV capacity) once its shard is built; the
driver answers ``Setup`` (the KV blocks every rank allocates), then sends one message per
step. ``LoadAdapter`` / ``UnloadAdapter`` are answered (``Reply``), and a ``Control``
(collective_rpc, weight updates, sleep, profiling: core/worker/worker_control.py) with its
``Result``; a step needs no answer, because its result reaches the driver through the
model's own collectives.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

#: bumped on any change to the messages below; a worker of another version is refused
PROTOCOL_VERSION = 2


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker process is started with (JSON, in its environment)."""

    protocol: int
    config_json: str
    driver_host: str
    control_port: int
    store_port: int
    #: the control channel's key (hex): a connection without it is refused
    authkey: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    timeout_s: float


class Hello(msgspec.Struct, tag="hello", frozen=True):
    rank: int
    protocol: int
    pid: int
    host: str
    #: registry -> sorted "name=module:qualname" lines (Components.fingerprint)
    fingerprint: dict[str, list[str]]


class Ready(msgspec.Struct, tag="ready", frozen=True):
    #: KV blocks this rank's memory budget holds, and host blocks its swap space holds
    kv_blocks: int
    host_blocks: int


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """A worker could not start (its build raised): the reason, for the driver's error."""

    error: str


class Setup(msgspec.Struct, tag="setup", frozen=True):
    num_blocks: int
    num_host_blocks: int


class Row(msgspec.Struct, array_like=True, frozen=True):
    """One scheduled request's part of a step: what ``ModelStep`` needs and nothing else
    (no sampling parameters: sampling happens on the driver)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    adapter: Optional[str] = None


class Step(msgspec.Struct, tag="step", frozen=True):
    rows: list[Row]
    #: flat token indices whose hidden states become logits (prompt logprobs, sampling)
    logits_rows: list[int]
    #: every logits row takes the argmax of its raw logits: only token ids come back
    greedy: bool


class Swap(msgspec.Struct, tag="swap", frozen=True):
    """(device block, host block) pairs to copy out to and in from the swap space."""

    out: list[tuple[int, int]]
    into: list[tuple[int, int]]


class LoadAdapter(msgspec.Struct, tag="load_adapter", frozen=True):
    name: str
    path: str
    #: the adapters the driver keeps loaded afterwards (its LRU knows which are in use)
    keep: list[str]


class UnloadAdapter(msgspec.Struct, tag="unload_adapter", frozen=True):
    name: str


class Control(msgspec.Struct, tag="control", frozen=True):
    """One of WorkerControl's operations, with its keyword arguments as JSON."""

    op: str
    payload: bytes


class Result(msgspec.Struct, tag="result", frozen=True):
    """A Control's answer: its value as JSON, or the error it raised."""

    value: bytes = b"null"
    error: Optional[str] = None


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class Reply(msgspec.Struct, tag="reply", frozen=True):
    error: Optional[str] = None


WorkerMessage = Union[Hello, Ready, Failed, Reply, Result]
DriverMessage = Union[Setup, Step, Swap, LoadAdapter, UnloadAdapter, Control, Shutdown]

_encoder = msgspec.msgpack.Encoder()
_from_worker = msgspec.msgpack.Decoder(WorkerMessage)
_from_driver = msgspec.msgpack.Decoder(DriverMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_from_worker(data: bytes) -> WorkerMessage:
    return _from_worker.decode(data)


def decode_from_driver(data: bytes) -> DriverMessage:
    return _from_driver.decode(data)

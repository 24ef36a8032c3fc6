"""What the API server and its engine-core process say to each other: msgspec messages,
never pickle.

The server sends ``Add``, ``Abort``, ``MetricsQuery`` and ``Shutdown``. The engine core
answers ``Ready`` (or ``StartFailed``) once built, then one ``Outputs`` per step that returned
any, ``Refused`` for a request its admission turned down, ``MetricsText`` for a query, and
``Stopped`` if its loop fails. A step's outputs are the hot path: they travel as arrays, not
maps, and a request's prompt travels back once, with its first output (the server keeps it).
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from tokenmill.interfaces.types import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams


class CoreSpec(msgspec.Struct, frozen=True):
    """What the engine-core process is started with (JSON, in its environment)."""

    config_json: str
    #: the file descriptor of its end of the socket pair
    fd: int
    #: the name its metrics carry (the first served model name)
    model_name: str
    log_requests: bool
    log_level: str
    log_format: str


# --- server -> engine core -------------------------------------------------------------------
class Add(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str]
    params: SamplingParams
    priority: int
    user: Optional[str]
    arrival_time: float
    adapter_name: Optional[str]


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class MetricsQuery(msgspec.Struct, tag="metrics_query", frozen=True):
    call_id: int


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


# --- engine core -> server -------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", frozen=True):
    pid: int
    #: the LoRA adapters the engine loaded at startup: name -> path
    adapters: dict[str, str]


class StartFailed(msgspec.Struct, tag="start_failed", frozen=True):
    """The engine could not be built; ``field`` is set when its config was at fault."""

    message: str
    field: Optional[str] = None


class WireCompletion(msgspec.Struct, array_like=True, frozen=True):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class WireOutput(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    outputs: list[WireCompletion]
    finished: bool
    num_cached_tokens: int
    error: Optional[str]
    #: the request's first output only: the prompt as the engine admitted it
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    #: its final output only
    metrics: Optional[RequestMetrics] = None


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    outputs: list[WireOutput]
    #: the queue after the step, and how many Adds the engine has taken so far (admitted or
    #: refused): the server's count of waiting requests adds the ones still on the way
    num_waiting: int
    num_running: int
    num_taken: int


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """A request's admission failed: ``param`` is set for a bad parameter (HTTP 400), else
    it is an internal error met by this request alone (HTTP 500)."""

    request_id: str
    message: str
    param: Optional[str]
    invalid: bool
    num_taken: int


class MetricsText(msgspec.Struct, tag="metrics_text", frozen=True):
    call_id: int
    text: bytes


class Stopped(msgspec.Struct, tag="stopped", frozen=True):
    """The engine loop failed; the process exits after sending this."""

    error: str


ToCore = Union[Add, Abort, MetricsQuery, Shutdown]
FromCore = Union[Ready, StartFailed, Outputs, Refused, MetricsText, Stopped]

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def wire_output(output: RequestOutput, first: bool) -> WireOutput:
    """A step's output for the wire: with its prompt if it is the request's first."""
    completions = [WireCompletion(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                                  c.stop_reason) for c in output.outputs]
    return WireOutput(output.request_id, completions, output.finished, output.num_cached_tokens, output.error,
                      output.prompt if first else None, output.prompt_token_ids if first else None,
                      output.prompt_logprobs, output.metrics if output.finished else None)


def request_output(wire: WireOutput, prompt: Optional[str], prompt_token_ids: list[int]) -> RequestOutput:
    """The RequestOutput a wire output stands for, given its request's prompt."""
    completions = [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                                    c.stop_reason) for c in wire.outputs]
    return RequestOutput(wire.request_id, prompt, prompt_token_ids, wire.prompt_logprobs, completions, wire.finished,
                         wire.num_cached_tokens, wire.metrics, wire.error)

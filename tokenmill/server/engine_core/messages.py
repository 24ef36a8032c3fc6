"""What the API server and its engine-core process say to each other: msgspec messages,
never pickle.

The server sends ``Add``, ``Abort``, ``Call``, ``StateSeen`` and ``Shutdown``. The engine core answers
``Ready`` (or ``StartFailed``) once built, then one ``Outputs`` per step that returned any,
``Refused`` for a request its admission turned down, ``CallDone`` for each call,
``EngineState`` to every server when a call changed what the routes read (pausing, the LoRA
adapters), and ``Stopped`` if its loop fails. With several API servers
(``--api-server-count``) each has a connection of its own and hears of its own requests
and calls only. A step's outputs are the hot path: they travel as arrays, not
maps, and a request's prompt travels back once, with its first output (the server keeps it).

A call is named, never code: an engine call (``engine_calls``), a pause or resume of the
loop, or its metrics' text. Its errors cross as one of a few kinds, raised on the server's
side as the exception types the routes map to their HTTP statuses.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
import torch

from tokenmill.core.engine.async_llm import RequestFailed
from tokenmill.core.engine.rollout import EngineAsleep
from tokenmill.interfaces.errors import InvalidRequest, RankCallFailed
from tokenmill.interfaces.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams


class CoreSpec(msgspec.Struct, frozen=True):
    """What the engine-core process is started with (JSON, in its environment)."""

    config_json: str
    #: the file descriptors of its ends of the socket pairs, one per API server
    fds: list[int]
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


class Call(msgspec.Struct, tag="call", frozen=True):
    """An engine call by name (``engine_calls.CALLS``), or the loop's own:
    ``pause_generation`` (mode, clear_cache), ``resume_generation``, ``metrics_text``."""

    call_id: int
    name: str
    kwargs: dict[str, Any]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class StateSeen(msgspec.Struct, tag="state_seen", frozen=True):
    """A server has read the EngineState of this version (its routes now read it)."""

    version: int


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


class WireError(msgspec.Struct, array_like=True, frozen=True):
    """An error met in the engine process, as one of the kinds its callers tell apart:
    ``invalid`` (a bad parameter, 400), ``asleep`` (503), ``timeout`` (a rank that did not
    answer), ``refused`` (a call's state or argument did not allow it), ``failed`` (else)."""

    kind: str
    message: str
    param: Optional[str] = None


class WireTensor(msgspec.Struct, array_like=True, frozen=True):
    """A call's float tensor (pooling's vectors), as float32 bytes."""

    shape: list[int]
    data: bytes


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """A request's admission failed; it alone fails."""

    request_id: str
    error: WireError
    num_taken: int


class CallDone(msgspec.Struct, tag="call_done", frozen=True):
    call_id: int
    result: Any = None
    tensor: Optional[WireTensor] = None
    error: Optional[WireError] = None


class EngineState(msgspec.Struct, tag="state", frozen=True):
    """What every API server's routes read of the engine, sent to each when a call changed
    it: whether generation is paused, and the LoRA adapters loaded (name -> path). Each
    server answers StateSeen; a call's CallDone waits until every server has, so that once
    a call returns, every server reads what it changed."""

    paused: bool
    adapters: dict[str, str]
    #: counts the changes
    version: int


class Stopped(msgspec.Struct, tag="stopped", frozen=True):
    """The engine loop failed; the process exits after sending this."""

    error: str


ToCore = Union[Add, Abort, Call, StateSeen, Shutdown]
FromCore = Union[Ready, StartFailed, Outputs, Refused, CallDone, EngineState, Stopped]

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


def wire_error(exc: Exception) -> WireError:
    """``exc``, raised in the engine process, for the wire."""
    if isinstance(exc, InvalidRequest):
        return WireError("invalid", str(exc), exc.param)
    if isinstance(exc, EngineAsleep):
        return WireError("asleep", str(exc))
    if isinstance(exc, TimeoutError):
        return WireError("timeout", str(exc))
    if isinstance(exc, (ValueError, RuntimeError, TypeError, RankCallFailed)):
        return WireError("refused", str(exc))
    return WireError("failed", repr(exc))


def raised(error: WireError, request_id: Optional[str] = None) -> Exception:
    """The exception the server raises for ``error``: the types an engine in its own
    process raises, so that each route answers with the status it does then. A request's
    failure of another kind is its RequestFailed (500)."""
    if error.kind == "invalid":
        exc = InvalidRequest(None, error.message)  # the message names its parameter already
        exc.param = error.param
        return exc
    if error.kind == "asleep":
        return EngineAsleep(error.message)
    if request_id is not None:
        return RequestFailed(request_id, error.message)
    if error.kind == "timeout":
        return TimeoutError(error.message)
    if error.kind == "refused":
        return RuntimeError(error.message)
    return Exception(error.message)


def wire_tensor(tensor: torch.Tensor) -> WireTensor:
    return WireTensor(list(tensor.shape), tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())


def tensor_of(wire: WireTensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(wire.data), dtype=torch.float32).reshape(wire.shape)

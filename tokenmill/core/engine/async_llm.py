"""AsyncLLM: the engine's step loop on its own thread, per-request async streams.

The HTTP event loop never runs model code: requests are validated and
tokenized on the caller's side, handed to the loop thread through a queue,
and every step's outputs are pushed back onto each request's asyncio.Queue.
A stream that is closed before its request finished (client disconnect,
cancellation) aborts the request, which frees its KV blocks on the next
loop iteration.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from functools import partial
from typing import Any, AsyncIterator, Callable, Optional

import structlog

from tokenmill.core.engine.engine_calls import run_call
from tokenmill.core.engine.generation_pause import GenerationPause, check_pause_mode
from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.loop_commands import AbortRequest, AddRequest, EngineCall, PauseRequest
from tokenmill.core.engine.prompt_input import PromptType
from tokenmill.core.engine.step_isolation import raise_if_fatal
from tokenmill.interfaces.errors import InvalidRequest, TokenmillError
from tokenmill.interfaces.outputs import RequestOutput
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams

log = structlog.get_logger("tokenmill.async_engine")

#: called on the loop thread after each step with that step's outputs
StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]


def observe_step(observers: list[StepObserver], engine: LLMEngine, outputs: list[RequestOutput]) -> None:
    """Metrics and logs see every step; one of them failing costs a data point, not the engine."""
    for observer in observers:
        try:
            observer(engine, outputs)
        except Exception:
            log.exception("a step observer failed", observer=getattr(observer, "__name__", repr(observer)))


class EngineOverloaded(TokenmillError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDead(TokenmillError):
    """The engine loop stopped after an internal error; no request can be served."""


class RequestFailed(TokenmillError):
    """Processing this one request failed inside the engine (HTTP 500); the engine serves on."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_queued_requests: Optional[int] = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.observers: list[StepObserver] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._pending_adds = 0
        self._draining = False
        #: pause_generation's state: held requests, pauses waiting to take effect
        self._pause: GenerationPause[PauseRequest, AddRequest] = GenerationPause(engine)
        self.error: Optional[BaseException] = None
        #: the loop has ended: requests, calls and pauses are refused (nothing would settle them)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # --- caller side (event loop) -----------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def prepare_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> dict:
        """Tokenize and validate on the caller's thread (tokenizers are thread-safe)."""
        text, token_ids = self.engine.tokenize_prompt(prompt, add_special_tokens)
        prepared = {"prompt": text, "prompt_token_ids": token_ids}
        if isinstance(prompt, dict) and "cache_salt" in prompt:
            prepared["cache_salt"] = prompt["cache_salt"]
        return prepared

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile a request's structured output constraint on a compiler thread, so that
        admission then finds it cached: a slow compile delays this request alone. An invalid
        constraint raises InvalidRequest here."""
        manager = self.engine.structured_outputs
        constraint = params.structured_outputs
        if constraint is not None and manager is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(manager.compile_async(constraint)),
                                       manager.COMPILE_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise InvalidRequest(constraint.param, f"the constraint did not compile within "
                                                       f"{manager.COMPILE_TIMEOUT_S:g} s; simplify it") from None

    def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        user: Optional[str] = None,
        adapter_name: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request now and return its stream of RequestOutputs (as ``params.output_kind``
        shapes them: cumulative, deltas, or the final one alone).

        Admission errors (overload, a dead engine, a duplicate id, token ids outside the
        vocabulary) raise here, before any response starts. The returned iterator must be
        consumed or closed: closing it early aborts the request.
        """
        if self.error is not None:
            raise self._ended()
        if self._draining:
            raise EngineOverloaded("the server is shutting down")
        if self.engine.control is not None:
            self.engine.control.check_awake()
        if self.max_queued_requests is not None and self.num_waiting >= self.max_queued_requests:
            raise EngineOverloaded(f"the waiting queue is full ({self.max_queued_requests} requests)")
        prepared = prompt if isinstance(prompt, dict) and "prompt_token_ids" in prompt else self.prepare_prompt(prompt)
        self.engine.check_params(params)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._stopped:  # the loop ended after the check above: nothing would serve this stream
                raise self._ended()
            if request_id in self._streams:
                raise InvalidRequest("request_id", f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
            self._pending_adds += 1
        self._send(AddRequest(request_id, prepared, params, priority, user, time.monotonic(), adapter_name))
        return self._iterate(request_id, stream, params.output_kind is RequestOutputKind.DELTA)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating (vLLM's name and modes) and return once paused: ``abort`` ends the
        running requests (finish_reason "abort"), ``wait`` lets them finish first, ``keep``
        freezes them until ``resume_generation``. Requests that arrive meanwhile wait, none
        is refused; ``clear_cache`` empties the prefix cache, frozen requests' blocks too (their
        KV stays theirs, never a hit again: a pause is where a trainer swaps the weights)."""
        check_pause_mode(mode)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send_awaited(PauseRequest(mode, clear_cache, future, loop))
        await future

    async def resume_generation(self) -> None:
        await self.run_on_engine(lambda engine: self._resume())

    def is_paused(self) -> bool:
        return self._pause.paused

    async def call(self, name: str, **kwargs: Any) -> Any:
        """The engine call ``name`` (``engine_calls``) between two steps, and its result."""
        return await self.run_on_engine(partial(run_call, name=name, kwargs=kwargs))

    async def run_on_engine(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send_awaited(EngineCall(fn, future, loop))
        return await future

    async def _iterate(self, request_id: str, stream: asyncio.Queue, delta: bool) -> AsyncIterator[RequestOutput]:
        """The request's outputs; those that arrived while the reader was busy come as one
        (``RequestOutput.add``, as vLLM's output collector does): a server behind on a stream
        writes one chunk for several steps, not a chunk per step it is behind by."""
        finished = False
        pending = None
        try:
            while True:
                item = pending if pending is not None else await stream.get()
                pending = None
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    item.add(later, delta)
                finished = item.finished
                if item.error is not None:
                    raise RequestFailed(request_id, item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def shutdown(self, drain_timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to ``drain_timeout`` seconds, then fail
        whatever still runs and stop the loop thread."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._stopping.set()
        self._wake.set()
        self._thread.join(10.0)
        self.engine.shutdown()

    def _send(self, command: object) -> None:
        self._commands.put(command)
        self._wake.set()

    def _send_awaited(self, command: "EngineCall | PauseRequest") -> None:
        """Queue a command whose caller awaits its future: refused once the loop has stopped
        (nothing would settle it), and settled with the loop's end if it stops first."""
        with self._lock:
            if self._stopped:
                raise self._ended()
            self._send(command)

    def _ended(self) -> EngineDead:
        """Why nothing is served any more: the loop's error, or a shutdown."""
        return EngineDead(f"the engine stopped: {self.error!r}" if self.error is not None
                          else "the server is shutting down")

    # --- loop thread -------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._drain_commands()
                self._settle_pauses(self._pause.settle())
                if self._pause.paused or not engine.has_unfinished_requests():
                    engine.check_health()  # an idle engine notices a dead worker too
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._observe(outputs)
                self._deliver_step(outputs)
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            log.exception("engine loop failed")
            engine.shutdown()  # a multi-process engine's surviving workers have nothing left to do
        finally:
            # 503 to every waiting client: the engine, not their request, is what failed
            ended = self._ended()
            with self._lock:
                self._stopped = True  # before failing the streams: none is registered after them
            self._fail_all(ended)
            self._fail_awaited(ended)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest) and self._pause.holds:
                self._pause.held.append(command)
            elif isinstance(command, AddRequest):
                self._admit(command)
            elif isinstance(command, PauseRequest):
                self._begin_pause(command)
            elif isinstance(command, EngineCall):
                try:
                    result, error = command.fn(self.engine), None
                except Exception as exc:  # handed to the awaiting caller
                    result, error = None, exc
                command.loop.call_soon_threadsafe(settle_future, command.future, result, error)
                if error is not None:  # a device fault (waking, loading weights) stops the loop as a step's does
                    raise_if_fatal(self.engine.platform, error)
            else:
                self._observe(self.engine.abort_request(command.request_id))
                with self._lock:
                    self._streams.pop(command.request_id, None)

    def _admit(self, command: AddRequest) -> None:
        with self._lock:
            self._pending_adds -= 1
        if command.request_id not in self._streams:
            return  # cancelled before it reached the engine
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    priority=command.priority, user=command.user,
                                    arrival_time=command.arrival_time, adapter_name=command.adapter_name)
        except TokenmillError as exc:
            self._deliver(command.request_id, exc, final=True)
        except Exception as exc:  # a bug met by this request alone: it fails, the loop goes on
            log.error("adding a request failed", request_id=command.request_id, exc_info=exc)
            self._deliver(command.request_id, RequestFailed(command.request_id, repr(exc)), final=True)

    def _begin_pause(self, command: PauseRequest) -> None:
        aborted = self._pause.pause(command.mode, command.clear_cache, command)
        self._observe(aborted)
        for output in aborted:
            self._deliver(output.request_id, output, final=True)

    def _resume(self) -> None:
        held, waiters = self._pause.resume()
        for command in held:
            self._admit(command)
        self._settle_pauses(waiters)

    @staticmethod
    def _settle_pauses(waiters: list[PauseRequest]) -> None:
        for command in waiters:
            command.loop.call_soon_threadsafe(settle_future, command.future, None, None)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        observe_step(self.observers, self.engine, outputs)

    def _deliver(self, request_id: str, item: object, final: bool) -> None:
        with self._lock:
            target = self._stream_of(request_id, final)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams with one wake-up of each event loop, not one per
        output: each ``call_soon_threadsafe`` writes to the loop's self-pipe, and with hundreds
        of streams that was a system call per request per step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                target = self._stream_of(output.request_id, output.finished)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], output))
        for loop, items in batches.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, items)

    def _stream_of(self, request_id: str, final: bool) -> Optional[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]:
        """A request's (loop, stream), forgotten with its final item; hold ``_lock``."""
        return self._streams.pop(request_id, None) if final else self._streams.get(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for loop, stream in streams.values():
            if not loop.is_closed():
                loop.call_soon_threadsafe(stream.put_nowait, exc)

    def _fail_awaited(self, exc: BaseException) -> None:
        """Settle the futures of the calls and pauses left in the queue (or pausing) with ``exc``,
        (new ones are refused: ``_stopped``)."""
        awaited: list = self._pause.waiters()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (EngineCall, PauseRequest)):
                awaited.append(command)
        for command in awaited:
            if not command.loop.is_closed():
                command.loop.call_soon_threadsafe(settle_future, command.future, None, exc)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def settle_future(future: asyncio.Future, result: object, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

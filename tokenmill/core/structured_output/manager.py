"""One engine's structured outputs: its backend, the compiled constraints cached by key, and
the threads that compile them off the step loop."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import structlog

from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.structured_output import (
    CompiledConstraint,
    InvalidConstraint,
    StructuredOutputBackend,
    StructuredOutputsParams,
)

log = structlog.get_logger("tokenmill.structured_output")


class StructuredOutputManager:
    """Compiles each distinct constraint once.

    The backend is built on first use (building xgrammar's tokenizer tables is not free,
    and most engines never see a constraint). ``compile_async`` is what the server awaits
    before admitting a request, so a slow compile delays that request alone; ``compiled``
    is the blocking form, which the engine calls at admission and which then hits the cache.
    """

    #: distinct compiled constraints kept (least recently used dropped first): a compiled
    #: grammar carries per-token tables (megabytes for a large vocabulary), and distinct
    #: schemas are the client's to choose
    MAX_CACHED = 64
    #: a compile that takes longer fails its request (the thread finishes it in the background)
    COMPILE_TIMEOUT_S = 60.0

    def __init__(self, name: str, make_backend: Callable[[], StructuredOutputBackend],
                 disable_additional_properties: bool = False) -> None:
        self.name = name
        #: close every JSON schema's open objects (the server-wide form of the request's field)
        self.disable_additional_properties = disable_additional_properties
        self._make_backend = make_backend
        self._backend: Optional[StructuredOutputBackend] = None
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-grammar")

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
                log.info("structured output backend ready", backend=self.name)
            return self._backend

    def compiled(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint: the one the request already carries, or the cache's, or
        compiled now; the request then carries it. A constraint the backend cannot take is an
        InvalidRequest naming the field it came from."""
        if params.compiled is not None and params.compiled[0] is self:
            return params.compiled[1]
        source = params
        if self.disable_additional_properties and params.kind == "json" and not params.disable_additional_properties:
            source = dataclasses.replace(params, disable_additional_properties=True)
        key = source.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                compiled = self._cache[key]
                object.__setattr__(params, "compiled", (self, compiled))
                return compiled
        backend = self.backend
        if not backend.supports(params.kind):
            raise InvalidRequest(params.param, f"the {self.name} structured output backend does not support "
                                               f"{params.kind} constraints")
        try:
            compiled = backend.compile(source)
        except InvalidConstraint as exc:
            raise InvalidRequest(params.param, f"invalid {params.kind} constraint: {exc}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.MAX_CACHED:
                self._cache.popitem(last=False)
        object.__setattr__(params, "compiled", (self, compiled))
        return compiled

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """``compiled(params)`` on a compiler thread."""
        return self._executor.submit(self.compiled, params)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Pausing a served engine's generation (vLLM's ``pause_generation`` and its modes), for
both loops that step one: AsyncLLM's engine thread and the engine-core process.

``abort`` ends the running requests (finish_reason "abort"), ``wait`` lets them finish
first, ``keep`` freezes them where they are. Requests that arrive while paused, or while a
pause waits, are held (none is refused) and admitted on resume. A pause can be waited on by
several callers: each is answered once it takes effect, and a resume that comes first
answers them too (the pause is over).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import structlog

from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.outputs import RequestOutput

log = structlog.get_logger("tokenmill.async_llm")

#: vLLM's pause modes
PAUSE_MODES = ("abort", "wait", "keep")

Waiter = TypeVar("Waiter")
Held = TypeVar("Held")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequest("mode", f"pause mode {mode!r}: one of {', '.join(PAUSE_MODES)}")


class GenerationPause(Generic[Waiter, Held]):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: no step runs (held until resume)
        self.paused = False
        #: the requests that arrived while paused or pausing, in order
        self.held: list[Held] = []
        #: the callers of pauses not yet in effect: (mode, clear_cache, waiter)
        self._pending: list[tuple[str, bool, Waiter]] = []

    @property
    def holds(self) -> bool:
        """Whether an arriving request is held rather than admitted."""
        return self.paused or bool(self._pending)

    def pause(self, mode: str, clear_cache: bool, waiter: Waiter) -> list[RequestOutput]:
        """Begin a pause; the outputs of the requests an ``abort`` ended, for their callers.
        ``settle`` says when it is in effect."""
        aborted = self.engine.abort_request(list(self.engine.outputs.states)) if mode == "abort" else []
        self._pending.append((mode, clear_cache, waiter))
        return aborted

    def settle(self) -> list[Waiter]:
        """Before each step: the waiters of the pauses that took effect now (at once, or for
        ``wait`` once nothing runs or generation is paused already), to be answered; the
        engine is then paused."""
        pending = self._pending
        if not pending:  # every step asks: nothing else is looked at
            return []
        waits = all(mode == "wait" for mode, _, _ in pending) and self.engine.has_unfinished_requests()
        if waits and not self.paused:  # paused already: nothing runs to wait for
            return []
        self.paused, self._pending = True, []
        if any(clear for _, clear, _ in pending):
            self.engine.scheduler.invalidate_prefix_cache()
        log.info("generation paused", mode=pending[-1][0], running=len(self.engine.scheduler.running))
        return [waiter for _, _, waiter in pending]

    def resume(self) -> tuple[list[Held], list[Waiter]]:
        """Generate again: the held requests, to admit in order, and the waiters of pauses
        that had not taken effect."""
        held, self.held = self.held, []
        waiters = self.waiters()
        self.paused, self._pending = False, []
        log.info("generation resumed", admitted=len(held))
        return held, waiters

    def waiters(self) -> list[Waiter]:
        """The waiters of pauses not yet in effect (answered with the loop's end if it stops)."""
        return [waiter for _, _, waiter in self._pending]

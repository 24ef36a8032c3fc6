"""What the callers of ``AsyncLLM`` hand its engine thread, through one queue: a request to
admit, a call to run between two steps, an abort, a pause. Calls and pauses carry the future
their caller awaits, settled on its own event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional

from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.interfaces.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: dict
    params: SamplingParams
    priority: int
    user: Optional[str]
    arrival_time: float
    adapter_name: Optional[str]


@dataclass(frozen=True)
class EngineCall:
    """Run ``fn(engine)`` on the engine thread between steps (adapter loads, ...)."""

    fn: Callable[[LLMEngine], object]
    future: "asyncio.Future"
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class PauseRequest:
    """Stop stepping in one of vLLM's pause modes (``generation_pause``); ``future`` is
    settled once the pause is in effect."""

    mode: str
    clear_cache: bool
    future: "asyncio.Future"
    loop: asyncio.AbstractEventLoop


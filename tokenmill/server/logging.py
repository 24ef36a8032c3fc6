"""structlog setup: JSON lines for machines, readable lines in a terminal; one line per request."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import structlog

from tokenmill.interfaces.outputs import RequestOutput

if TYPE_CHECKING:  # `tokenmill serve` configures logging before torch is imported
    from tokenmill.core.engine.llm_engine import LLMEngine

log = structlog.get_logger("tokenmill.requests")


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def log_finished_requests(engine: LLMEngine, outputs: list[RequestOutput]) -> None:
    """StepObserver: one line per finished request, with its latency figures."""
    for progress in engine.last_step_progress:
        if progress.finish_reasons is None:
            continue
        m = progress.metrics
        ttft = None if m.first_token_time is None else round(m.first_token_time - m.arrival_time, 4)
        e2e = None if m.finished_time is None else round(m.finished_time - m.arrival_time, 4)
        log.info("request finished", request_id=progress.request_id,
                 prompt_tokens=m.num_prompt_tokens, generation_tokens=m.num_generation_tokens,
                 cached_tokens=progress.num_cached_tokens, ttft_s=ttft, e2e_s=e2e,
                 finish_reason=list(progress.finish_reasons),
                 preemptions=m.num_preemptions,
                 **({"spec_draft_tokens": m.num_draft_tokens, "spec_accepted_tokens": m.num_accepted_tokens}
                    if m.num_draft_tokens else {}))

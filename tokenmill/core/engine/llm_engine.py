"""LLMEngine: add_request / step / abort over scheduler, model runner and outputs.

A request is checked against the model once, when it is added; after that, an
exception while one request is processed (its sampling, detokenizing, stop
check, a plugin hook) finishes that request with ``finish_reason="error"`` and
the engine serves on (a batch that raises runs again request by request:
``step_isolation``). Only errors in the scheduler's own bookkeeping, and a
worker of a multi-process model failing (``WorkerFailed``), propagate out of
``step``: those leave the engine unable to run another step.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Optional, Sequence

import structlog

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.config.model_config import ModelConfig
from tokenmill.core.distributed.driver import WorkerGroup
from tokenmill.core.engine.output_processor import OutputProcessor, RequestProgress
from tokenmill.core.engine.prompt_input import PromptType, cache_salt, tokenize_prompt
from tokenmill.core.engine.request import Request
from tokenmill.core.engine.step_isolation import NOTHING, execute, isolate, raise_if_fatal
from tokenmill.core.plugin_host.plugin_manager import PluginManager
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.spec_decode.speculator import Speculator
from tokenmill.core.structured_output.manager import StructuredOutputManager
from tokenmill.core.worker.model_runner import LaunchedStep, ModelRunner
from tokenmill.interfaces.adapters import AdapterType
from tokenmill.interfaces.batch import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from tokenmill.interfaces.errors import InvalidRequest, WorkerFailed
from tokenmill.interfaces.logits_processor import LogitsProcessor
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.outputs import FinishReason, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.engine.rollout import EngineControl

log = structlog.get_logger("tokenmill.engine")


def check_params(params: SamplingParams, model_config: ModelConfig,
                 structured_outputs: Optional[StructuredOutputManager],
                 processors: Sequence[type[LogitsProcessor]]) -> None:
    """What a request's parameters must satisfy for a model: token ids in its vocabulary, a
    constraint a backend can follow and an end-of-sequence token can end, and what each
    logits processor's ``validate_params`` asks."""
    vocab = model_config.vocab_size
    for param, token in params.token_ids():
        if not 0 <= token < vocab:
            raise InvalidRequest(param, f"token ids must be in [0, {vocab}), got {token}")
    constraint = params.structured_outputs
    if constraint is not None and structured_outputs is None:
        raise InvalidRequest(constraint.param, "structured outputs need a backend: pip install xgrammar "
                                               "(or llguidance), or register one")
    if constraint is not None and not model_config.eos_token_ids:
        raise InvalidRequest(constraint.param, "this model has no end-of-sequence token, so a completed "
                                               "constraint could not end the reply")
    for processor in processors:
        try:
            processor.validate_params(params)
        except InvalidRequest:
            raise
        except (ValueError, TypeError) as exc:  # vLLM's processors refuse with ValueError
            raise InvalidRequest("vllm_xargs", f"{processor.__name__}: {exc}") from None


class LLMEngine:
    """The synchronous engine. Not thread-safe: one caller drives ``step``."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Any,
        scheduler: Scheduler,
        runner: ModelRunner,
        plugin_manager: PluginManager,
        adapters: Optional[AdapterType] = None,
        platform: Optional[Platform] = None,
        structured_outputs: Optional[StructuredOutputManager] = None,
        workers: Optional[WorkerGroup] = None,
        speculator: Optional[Speculator] = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.plugin_manager = plugin_manager
        self.adapters = adapters
        #: the platform the engine was built for (tokenmill.interfaces.platform)
        self.platform = platform
        #: compiles structured output constraints (None: no backend installed)
        self.structured_outputs = structured_outputs
        #: the ranks beyond this process of a multi-process model (None: one process)
        self.workers = workers
        #: proposes draft tokens between steps (None: no speculative decoding)
        self.speculator = speculator
        if workers is not None:  # an engine dropped without shutdown() still stops its workers
            self._finalizer = weakref.finalize(self, workers.shutdown)
        if adapters is not None:
            adapters.in_use = lambda name: any(r.adapter_name == name for r in scheduler.requests.values())
        self.outputs = OutputProcessor(tokenizer)
        self._arrivals = itertools.count()
        #: launched batches whose results are not in yet (pipeline parallelism, async
        #: scheduling), oldest first, and how many are launched before the oldest is sampled
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()
        self._depth = max(scheduler.pipeline_depth, 2 if scheduler.async_scheduling else 1)
        self._warned_priority = False
        #: the queue after the latest step (for metrics and observers)
        self.last_scheduler_stats: Optional[SchedulerStats] = None
        #: the user requests the last step (or abort) advanced, finished or failed: metrics
        #: and logs count from these, since a step returns no output of a FINAL_ONLY request
        #: until it ends
        self.last_step_progress: list[RequestProgress] = []
        #: the training-loop API: worker RPCs, weight updates, sleep (set by the builder)
        self.control: Optional["EngineControl"] = None

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def is_classifier(self) -> bool:
        """A sequence-classification model: it classifies prompts, and generates nothing."""
        return bool(getattr(self.runner.model_step.model, "is_classifier", False))

    # --- requests ----------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids) for any accepted prompt form, validated against this model."""
        return tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size, add_special_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """What a request's parameters must satisfy for this model (token ids in its vocabulary).
        Thread-safe: AsyncLLM calls it on the caller's side, so the error comes before a response."""
        check_params(params, self.model_config, self.structured_outputs,
                     [type(processor) for processor in self.runner.sampler.processors])

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        adapter_name: Optional[str] = None,
        user: Optional[str] = None,
    ) -> None:
        params = params or SamplingParams()
        if self.control is not None:
            self.control.check_awake()
        if self.is_classifier:
            raise InvalidRequest("model", f"{self.model_config.architecture} classifies: it generates nothing (use "
                                          "classify, score, or the /classify, /v1/score and /pooling routes)")
        text, token_ids = self.tokenize_prompt(prompt)
        salt = cache_salt(prompt)
        self.check_params(params)
        if params.structured_outputs is not None:  # compiled now unless the caller compiled it already
            self.structured_outputs.compiled(params.structured_outputs)
        kept = params.truncated_prompt(token_ids, self.max_model_len)
        if len(kept) < len(token_ids):
            text, token_ids = None, kept  # the text no longer matches the tokens that run
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"the prompt has {len(token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, so at most {self.max_model_len - 1} fit",
            )
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        # under async scheduling the last step of a request that just finished may still be in
        # flight under its id: a new sequence that would reuse it takes another, so that
        # step's result cannot reach it
        child_ids = [f"{c}\x00{next(self._arrivals)}" if c in self.scheduler.in_flight else c for c in child_ids]
        if request_id in self.outputs.states or any(self.outputs.parent_of(c) or c in self.scheduler.requests
                                                    for c in child_ids):
            raise InvalidRequest("request_id", f"request id {request_id!r} is already in use")
        if priority and not self._warned_priority and not getattr(self.scheduler.policy, "uses_priority", False):
            self._warned_priority = True
            log.warning("request priorities are ignored by this scheduling policy; "
                        "use scheduling_policy='priority'", policy=self.config.scheduler.policy)
        adapter_key = None
        if adapter_name is not None:
            loaded = self.adapters.loaded() if self.adapters is not None else {}
            if adapter_name not in loaded:
                raise InvalidRequest("model", f"adapter {adapter_name!r} is not loaded"
                                              + ("" if self.adapters else " (the engine runs without enable_lora)"))
            adapter_key = f"{adapter_name}\x00{loaded[adapter_name]}"
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.outputs.add(request_id, text, token_ids, params, child_ids, arrival_time)
        for index, child_id in enumerate(child_ids):
            # a generator takes any 64-bit pattern; wrapping keeps seed + index inside that
            seed = None if params.seed is None else (params.seed + index) % 2**64
            self.scheduler.add_request(Request(
                child_id, token_ids, params,
                arrival_time=arrival_time,
                arrival_index=next(self._arrivals),
                eos_token_ids=self.model_config.eos_token_ids,
                max_model_len=self.max_model_len,
                priority=priority,
                seed=seed,
                adapter_name=adapter_name,
                adapter_key=adapter_key,
                cache_salt=salt,
                user=user,
            ))

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort user requests (all their sequences) and free their blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs, self.last_step_progress = [], []
        for request_id in request_ids:
            children = self.outputs.child_ids(request_id)
            for request in self.scheduler.finish_requests(children, FinishReason.ABORT):
                self.outputs.finish(request)
            if children:
                progress, emitted = self.outputs.collect([request_id])
                self.last_step_progress += progress
                outputs += self._announce(emitted)
        progress = self.last_step_progress
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            self._finish_oldest()  # steps of aborted requests only: the engine is idle once they land
        self.last_step_progress = progress
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise WorkerFailed once a worker of a multi-process model is gone."""
        if self.workers is not None:
            self.workers.check_health()

    def shutdown(self) -> None:
        """Stop the worker processes, if any (safe to call twice)."""
        if self.workers is not None:
            self.workers.shutdown()

    # --- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that advanced or failed.

        Under pipeline parallelism up to ``pipeline_parallel_size`` batches are in flight: a
        step launches the next batch (its requests are none of those in flight) before it
        samples the oldest one, so every stage has work while the last one finishes."""
        self.last_step_progress = []
        if self._depth > 1:
            return self._step_pipelined()
        batch = self._schedule()
        self.runner.prepare(batch)
        result, failures = execute(self.runner, batch, self._raise_if_fatal)
        return self._advance(batch, result, failures)

    def _schedule(self) -> SchedulerOutput:
        batch = self.scheduler.schedule()
        self.last_scheduler_stats = batch.stats
        if self.speculator is not None:  # their KV is gone, or they are
            self.speculator.forget([*batch.finished_request_ids, *batch.preempted_request_ids])
        return batch

    def _step_pipelined(self) -> list[RequestOutput]:
        """Launch the next batch, then sample and apply the oldest in flight once ``_depth``
        are (pipeline parallelism; async scheduling, with a depth of two)."""
        batch = self._schedule()
        self.runner.prepare(batch)
        if not batch.is_empty:
            # the random state a failed launch rewinds to (async scheduling isolates its requests)
            generators = self.runner.generator_states(batch) if self.scheduler.async_scheduling else []
            try:
                launched = self.runner.launch(batch)
            except WorkerFailed:
                raise
            except Exception as exc:
                self._raise_if_fatal(exc)
                if not self.scheduler.async_scheduling:  # this batch fails; the ones in flight go on
                    return self._advance(batch, NOTHING, {item.request_id: exc for item in batch.scheduled})
                # the step in flight first (this batch's placeholders are its tokens), then this
                # batch one request at a time, so that only the requests that fail end
                outputs = self._finish_oldest() if self._in_flight else []
                progress = self.last_step_progress
                result, failures = isolate(self.runner, batch, exc, generators, self._raise_if_fatal)
                outputs += self._advance(batch, result, failures)
                self.last_step_progress = progress + self.last_step_progress
                return outputs
            self._in_flight.append((batch, launched))
            self.scheduler.in_flight.update((item.request_id, item) for item in batch.scheduled)
        if not self._in_flight or (len(self._in_flight) < self._depth and not batch.is_empty):
            return []
        return self._finish_oldest()

    def _finish_oldest(self) -> list[RequestOutput]:
        batch, launched = self._in_flight.popleft()
        in_flight = self.scheduler.in_flight
        for item in batch.scheduled:
            if in_flight.get(item.request_id) is item:
                del in_flight[item.request_id]
        try:
            result, failures = self.runner.finish(launched), {}
        except WorkerFailed:
            raise
        except Exception as exc:
            self._raise_if_fatal(exc)
            result, failures = NOTHING, {item.request_id: exc for item in batch.scheduled}
        return self._advance(batch, result, failures)

    def _advance(self, batch: SchedulerOutput, result: ModelRunnerOutput,
                 failures: dict[str, BaseException]) -> list[RequestOutput]:
        """Apply a step's result: failed requests end, the others get their tokens and stops."""
        failed: dict[str, None] = {}  # user requests that failed in this step
        for child_id, exc in failures.items():
            self._fail(child_id, exc, failed)
        advanced = self.scheduler.update(batch, result)

        for child_id, entries in result.prompt_logprobs.items():
            if self.outputs.parent_of(child_id) in failed:
                continue
            try:
                self.outputs.add_prompt_logprobs(child_id, entries)
            except Exception as exc:
                self._fail(child_id, exc, failed)
        touched: dict[str, None] = {}
        for request, num_tokens in advanced:
            parent = self.outputs.parent_of(request.request_id)
            if parent in failed:
                continue
            try:
                stop = self._add_tokens(request, num_tokens, result)
            except Exception as exc:
                self._fail(request.request_id, exc, failed)
                continue
            if stop is not None and not request.is_finished:
                self.scheduler.finish_requests([request.request_id], FinishReason.STOP, stop)
            elif stop is not None:  # a token-level stop in the same step: the string wins
                request.finish_reason, request.stop_reason = FinishReason.STOP, stop
            if request.is_finished:
                self.outputs.finish(request)
            touched[parent] = None
        touched.update(failed)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        self.last_step_progress, outputs = self.outputs.collect(touched)
        return self._announce(outputs)

    def _add_tokens(self, request: Request, num_tokens: int, result: ModelRunnerOutput) -> Optional[str]:
        """Hand a request's new tokens to its output one at a time; the first stop string
        ends it, and the tokens after that one are dropped."""
        tokens = result.sampled_token_ids[request.request_id][:num_tokens]
        entries = result.logprobs.get(request.request_id) or [None] * len(tokens)
        for token, entry in zip(tokens, entries):
            stop = self.outputs.add_token(request, token, entry)
            if stop is not None:
                return stop
        return None

    def _raise_if_fatal(self, exc: BaseException) -> None:
        raise_if_fatal(self.platform, exc)

    def _fail(self, child_id: str, exc: BaseException, failed: dict[str, None]) -> None:
        """Finish the user request ``child_id`` belongs to, all its sequences, as failed, and
        add it to ``failed``."""
        parent = self.outputs.parent_of(child_id)
        if parent is None:  # no output state: only the scheduler's sequence is left to end
            log.error("a sequence without a request failed", request_id=child_id, exc_info=exc)
            self.scheduler.finish_requests([child_id], FinishReason.ERROR)
            return
        log.error("request failed; the engine serves on", request_id=parent, exc_info=exc)
        self.outputs.fail(parent, f"{type(exc).__name__}: {exc}")
        self.scheduler.finish_requests(self.outputs.child_ids(parent), FinishReason.ERROR)
        failed[parent] = None

    def _announce(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Tell the plugins of the requests among ``outputs`` that finished; returns ``outputs``."""
        for output in outputs:
            if output.finished:
                try:
                    self.plugin_manager.hook.request_finished(output=output, metrics=output.metrics)
                except Exception:  # a plugin's bookkeeping must not take the engine down
                    log.exception("a request_finished hook failed", request_id=output.request_id)
        return outputs

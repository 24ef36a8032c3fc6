"""Running a batch so that a request that raises fails alone.

A step runs every scheduled request at once. When it raises (a request's sampling, an
adapter, a plugin's processor), the batch runs again one request at a time to find the ones
that fail; the others get what a clean step would have given them: a retry recomputes the
same KV into the same slots, and the generators are wound back first. What no request
survives (a worker of a multi-process model gone, a device error the platform calls fatal)
is not a request's failure and propagates.
"""

from __future__ import annotations

import traceback
from typing import Callable, Optional

from tokenmill.core.worker.model_runner import ModelRunner
from tokenmill.interfaces.batch import ModelRunnerOutput, SchedulerOutput
from tokenmill.interfaces.errors import DeviceFailed, WorkerFailed
from tokenmill.interfaces.platform import Platform

#: a step that produced nothing
NOTHING = ModelRunnerOutput({}, {}, {})

Failures = dict[str, BaseException]


def raise_if_fatal(platform: Optional[Platform], exc: BaseException) -> None:
    """A device error no request survives (the platform says which) stops the engine."""
    if platform is not None and platform.is_fatal_error(exc):
        raise DeviceFailed(f"the {platform.name} device failed, and this process cannot use it again: "
                           f"{exc}") from exc


def execute(runner: ModelRunner, batch: SchedulerOutput,
            raise_fatal: Callable[[BaseException], None]) -> tuple[ModelRunnerOutput, Failures]:
    """Run a prepared batch (``runner.prepare``: the engine's own bookkeeping, whose failure
    propagates); if that raises, run its requests one at a time (``isolate``)."""
    generators = runner.generator_states(batch)
    try:
        return runner.execute(batch), {}
    except WorkerFailed:  # the model's ranks are out of step: no request can run again
        raise
    except Exception as exc:
        raise_fatal(exc)
        return isolate(runner, batch, exc, generators, raise_fatal)


def isolate(runner: ModelRunner, batch: SchedulerOutput, exc: BaseException, generators: list,
            raise_fatal: Callable[[BaseException], None]) -> tuple[ModelRunnerOutput, Failures]:
    """Run the requests of a batch that raised ``exc`` one at a time, from the random state
    ``generators`` held before it (``runner.generator_states``)."""
    # the exception's frames (and those of the exceptions it chains) hold the failed step's
    # tensors (activations, logits): freed before the retries, which an out-of-memory step
    # needs; the messages and lines stay
    chained, seen = exc, set()
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    if len(batch.scheduled) <= 1:
        return NOTHING, {item.request_id: exc for item in batch.scheduled}
    sampled, logprobs, prompt_logprobs, failures = {}, {}, {}, {}
    runner.restore_generators(generators)  # each seeded generator serves one request only
    for item in batch.scheduled:
        single = SchedulerOutput(scheduled=(item,), new_requests=(), finished_request_ids=frozenset(),
                                 num_scheduled_tokens=len(item.new_token_ids))
        try:
            part = runner.execute(single)
        except WorkerFailed:
            raise
        except Exception as error:
            raise_fatal(error)
            failures[item.request_id] = error
            continue
        sampled.update(part.sampled_token_ids)
        logprobs.update(part.logprobs)
        prompt_logprobs.update(part.prompt_logprobs)
    return ModelRunnerOutput(sampled, logprobs, prompt_logprobs), failures

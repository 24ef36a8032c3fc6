"""The executor contract: which processes, on which machines, run a model's ranks.

An engine whose model spans several ranks (tensor and pipeline parallelism) keeps rank 0,
the driver, in its own process: the scheduler and sampler live there, and so nothing
per-token leaves the process but the step's plan. An executor starts the other ranks and
says whether they still live; what flows between the ranks is the engine's versioned
protocol (control messages over an authenticated socket, tensors over torch.distributed),
the same under every executor, so that an executor cannot get it subtly wrong.

Each started rank runs ``launch.command(rank)`` as a process (or calls
``tokenmill.core.distributed.worker.run_worker(launch.spec, rank)`` in one it owns, as the
Ray executor's actors do). A rank builds its own plugin manager from entry points: a
component registered only in the driver's memory does not exist there, and the engine
refuses to start (it compares every rank's fingerprint of its registries).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class WorkerLaunch:
    """What starting ranks ``ranks`` takes."""

    ranks: tuple[int, ...]
    #: the worker spec (JSON): config, where the driver listens, the group's size and timeout.
    #: It carries the control channel's key: pass it by environment or call argument, never argv
    spec: str

    def command(self, rank: int) -> list[str]:
        """argv of a worker process; the spec goes in the TOKENMILL_WORKER_SPEC env var."""
        # -P: the working directory does not shadow installed packages
        return [sys.executable, "-P", "-m", "tokenmill.core.distributed.worker", str(rank)]


class Executor(ABC):
    """Starts, watches and stops the ranks beyond the driver."""

    name: ClassVar[str]

    def __init__(self, options: Any = None) -> None:
        self.options = options

    def driver_host(self) -> str:
        """The address workers reach the driver at (loopback for one machine)."""
        return "127.0.0.1"

    @abstractmethod
    def launch(self, launch: WorkerLaunch) -> None:
        """Start one worker per rank in ``launch.ranks``; return without waiting for them."""

    @abstractmethod
    def failed_workers(self) -> list[str]:
        """A line per started worker that is no longer running (empty while all live)."""

    @abstractmethod
    def shutdown(self, grace_s: float) -> None:
        """Stop every worker: they were asked to exit; after ``grace_s`` seconds, kill.
        Must leave no process behind, and be safe to call twice."""

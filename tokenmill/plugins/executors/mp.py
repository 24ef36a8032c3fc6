"""``mp``: one worker process per rank beyond the driver, on this machine.

Workers are fresh interpreters (``python -m tokenmill.core.distributed.worker``), not forks:
nothing of the engine's memory (threads, locks, a plugin registered at runtime) leaks into
them, and the spec reaches them through the environment rather than a pickle.
"""

from __future__ import annotations

import os
import subprocess
import time

from tokenmill.interfaces.executor import Executor, WorkerLaunch


class MultiprocessExecutor(Executor):
    name = "mp"

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self._processes: dict[int, subprocess.Popen] = {}

    def launch(self, launch: WorkerLaunch) -> None:
        env = {**os.environ, "TOKENMILL_WORKER_SPEC": launch.spec}
        for rank in launch.ranks:
            self._processes[rank] = subprocess.Popen(launch.command(rank), env=env, stdin=subprocess.DEVNULL)

    def failed_workers(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                for rank, p in sorted(self._processes.items()) if p.poll() is not None]

    def shutdown(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self._processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

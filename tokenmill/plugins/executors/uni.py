"""``uni``: the whole model in the engine's process (one rank)."""

from __future__ import annotations

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.executor import Executor, WorkerLaunch


class UniExecutor(Executor):
    name = "uni"

    def launch(self, launch: WorkerLaunch) -> None:
        raise ConfigError("parallel.distributed_executor_backend",
                          "'uni' runs one rank in the engine's process; for tensor_parallel_size or "
                          "pipeline_parallel_size above 1 use 'mp' or 'ray'")

    def failed_workers(self) -> list[str]:
        return []

    def shutdown(self, grace_s: float) -> None:
        pass

"""``ray``: worker ranks as Ray actors in a placement group, on one machine or across a cluster.

The engine connects to the Ray cluster named by ``RAY_ADDRESS`` (or the one already
initialised in this process, or starts a local one). One bundle of one CPU per worker rank
is reserved, packed onto as few machines as fit; each actor runs the same worker loop as
an ``mp`` process, so the protocol and the collectives are the same. Ray only places and
starts the actors: the spec is a JSON string, and steps and tensors never pass through it.
"""

from __future__ import annotations

from typing import Any

from tokenmill.interfaces.errors import ComponentUnavailable, WorkerFailed
from tokenmill.interfaces.executor import Executor, WorkerLaunch

#: seconds the placement group may take to be granted
PLACEMENT_TIMEOUT_S = 120.0


class _WorkerActor:
    def run(self, spec: str, rank: int) -> None:
        from tokenmill.core.distributed.worker import run_worker

        run_worker(spec, rank)


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        try:
            import ray
        except ImportError:
            raise ComponentUnavailable("the 'ray' executor needs Ray: pip install 'tokenmill[ray]'") from None
        self._ray = ray
        self._actors: list[Any] = []
        self._runs: dict[int, Any] = {}
        self._group = None

    def _connect(self) -> None:
        if not self._ray.is_initialized():
            self._ray.init(log_to_driver=True)

    def driver_host(self) -> str:
        self._connect()
        return self._ray.util.get_node_ip_address()

    def launch(self, launch: WorkerLaunch) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect()
        self._group = placement_group([{"CPU": 1}] * len(launch.ranks), strategy="PACK")
        try:
            self._ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as exc:
            raise WorkerFailed(f"Ray could not place {len(launch.ranks)} worker(s) of 1 CPU each within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s: {exc}") from exc
        actor_class = self._ray.remote(num_cpus=1)(_WorkerActor)
        for index, rank in enumerate(launch.ranks):
            actor = actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=index)).remote()
            self._actors.append(actor)
            self._runs[rank] = actor.run.remote(launch.spec, rank)

    def failed_workers(self) -> list[str]:
        if not self._runs:
            return []
        done, _ = self._ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=0)
        failed = []
        for rank, ref in sorted(self._runs.items()):
            if ref in done:
                try:
                    self._ray.get(ref)
                    failed.append(f"rank {rank} (Ray actor) returned")
                except Exception as exc:
                    failed.append(f"rank {rank} (Ray actor) failed: {type(exc).__name__}: {str(exc)[:300]}")
        return failed

    def shutdown(self, grace_s: float) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._runs:
            self._ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=grace_s)
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors, self._runs = [], {}
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

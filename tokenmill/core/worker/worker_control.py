"""One rank's side of the engine's control calls: worker-extension RPCs, weight updates,
sleep and wake, profiling. Rank 0 runs them in the engine's process; the other ranks run
the same on their ``Control`` message (core/distributed), so every rank does its part.

Each operation is a method named as its ``op``; ``handle(op, payload)`` runs only those in
``OPS`` (nothing arbitrary is reachable from a message), and its result is JSON.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec
import torch

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.model_loader.safetensors_files import iterate_weights
from tokenmill.core.model_loader.weights import load_strictly
from tokenmill.core.plugin_host.components import Components
from tokenmill.core.worker.kv_cache import SwapCaches
from tokenmill.core.worker.model_builder import BuiltModel
from tokenmill.core.worker.model_step import ModelStep
from tokenmill.interfaces.platform import Platform
from tokenmill.interfaces.weight_transfer import WeightTransferBackend, WeightTransferContext
from tokenmill.interfaces.worker_extension import WorkerContext

#: the operations a control message may ask for
OPS = ("collective_rpc", "init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update",
       "sleep", "wake_up", "start_profile", "stop_profile")


@dataclass
class RankParts:
    """What one rank built: its model step and what allocating its caches again takes."""

    config: EngineConfig
    components: Components
    platform: Platform
    built: BuiltModel
    step: ModelStep
    num_blocks: int
    num_host_blocks: int
    #: records the decode graphs again (their addresses changed); None where there are none
    record_graphs: Optional[Callable[[], Any]] = None


class WorkerControl:
    def __init__(self, parts: RankParts) -> None:
        self.parts = parts
        self._extensions: dict[str, Any] = {}
        self._backend: Optional[WeightTransferBackend] = None
        #: parameter shapes and dtypes while the weights sleep (level 2)
        self._released: Optional[dict[str, tuple[torch.Size, torch.dtype]]] = None
        #: a device's weights in host memory while they sleep at level 1
        self._offloaded: Optional[dict[str, torch.Tensor]] = None
        self._kv_released = False
        self._profiler: Optional[torch.profiler.profile] = None
        #: whether the step samples greedy rows through the platform's head, awake (sleep drops it)
        self._has_greedy_head = parts.step.greedy_head is not None

    @property
    def model(self) -> torch.nn.Module:
        return self.parts.built.model

    def handle(self, op: str, payload: dict[str, Any]) -> Any:
        if op not in OPS:
            raise ValueError(f"unknown control operation {op!r}")
        return getattr(self, op)(**payload)

    # --- worker extensions ----------------------------------------------------
    def collective_rpc(self, method: Any, args: list, kwargs: dict) -> Any:
        """``method`` of the registered worker extensions (a callable, on a one-rank engine)."""
        if callable(method):
            return method(self.context(), *args, **kwargs)
        result = self._extension_method(method)(*args, **kwargs)
        try:
            msgspec.json.encode(result)
        except (TypeError, msgspec.EncodeError) as exc:
            raise TypeError(f"{method} returned {type(result).__name__}, which is not JSON (numbers, strings, "
                            f"lists, dicts; convert tensors with .tolist()): {exc}") from None
        return result

    def context(self) -> WorkerContext:
        parallel = self.parts.built.parallel
        return WorkerContext(parallel.rank, parallel.world_size, parallel.tp_rank, parallel.tp_size,
                             parallel.pp_rank, parallel.pp_size, self.model,
                             torch.device(self.parts.platform.device_type), self.parts.config)

    def _extension_method(self, method: str) -> Callable[..., Any]:
        registry = self.parts.components.worker_extensions
        name, _, attr = method.rpartition(".")
        names = [name] if name else [n for n in registry.names() if _public(registry.get(n), attr)]
        if not names or not all(n in registry and _public(registry.get(n), attr) for n in names):
            raise AttributeError(f"no worker extension has a method {method!r} (registered: "
                                 f"{', '.join(registry.names()) or 'none'}; install one as a package with a "
                                 "register_worker_extensions hook)")
        if len(names) > 1:
            raise AttributeError(f"{attr!r} is a method of several worker extensions ({', '.join(names)}): "
                                 f"call it as 'extension.{attr}'")
        if names[0] not in self._extensions:
            self._extensions[names[0]] = registry.get(names[0])(self.context())
        return getattr(self._extensions[names[0]], attr)

    # --- weight updates -------------------------------------------------------
    def init_weight_transfer(self, backend: str, init_info: dict[str, Any]) -> None:
        parallel = self.parts.built.parallel
        cls = self.parts.components.weight_transfer_backends.get(backend)
        if self._backend is not None:
            self._backend.shutdown()
        self._backend = cls(WeightTransferContext(parallel.rank, parallel.world_size,
                                                  parallel.comm if parallel.world_size > 1 else None,
                                                  self.parts.platform.device_type))
        self._backend.init_transfer(init_info)

    def start_weight_update(self) -> None:
        if self._backend is None:
            raise RuntimeError("call init_weight_transfer_engine first")

    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receive the update and copy each tensor into this rank's shard; how many came."""
        if self._backend is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        count = 0
        with torch.no_grad():
            for name, tensor in self._backend.receive_weights(update_info):
                self.model.load_weights([(name, tensor)])
                count += 1
        return count

    def finish_weight_update(self) -> None:
        """Rebuild what was derived from the weights: the platform's packed copies, the
        greedy head, the decode graphs."""
        self._refresh()

    def _refresh(self) -> None:
        parts = self.parts
        parts.platform.refresh_weights(self.model)
        if self._has_greedy_head:
            asleep = self._released is not None or self._offloaded is not None
            parts.step.greedy_head = None if asleep else parts.platform.greedy_head(self.model)
        # a recorded graph holds addresses: where the update copied into the same tensors (the
        # loaders do; the cuda platform derives nothing from the weights) it replays as it is, and
        # a trainer's every update skips recording each bucket again. Where a tensor moved, the old
        # graphs go first, so that the new ones reuse their memory instead of holding it twice.
        if parts.record_graphs is not None and parts.step.graphs is not None \
                and not parts.step.graphs.addresses_unchanged():
            parts.step.graphs = None
            parts.step.graphs = parts.record_graphs()

    # --- sleep ----------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache and moves a device's weights to host memory (on the
        cpu platform they are there already); level 2 frees the weights too."""
        offloaded = None
        if level == 1 and self.parts.platform.device_type != "cpu" and self._offloaded is None \
                and self._released is None:
            # first, so that a failure (host memory) leaves the engine as it was. A device
            # tensor's non-blocking copy to the host lands in pinned memory (torch's rule), at the
            # link's speed, where a pageable one is staged and waited for tensor by tensor; one
            # wait after them all, before the device memory is let go
            offloaded = {name: param.data.to("cpu", non_blocking=True)
                         for name, param in self.model.named_parameters()}
            self.parts.platform.record_event().synchronize()
        for module in self.model.modules():
            if getattr(module, "kv_cache", None) is not None:
                module.kv_cache = None
        if self.parts.step.swap is not None:
            self.parts.step.swap = None
        self._kv_released = True
        if self.parts.step.graphs is not None:  # they hold the caches' addresses
            self.parts.step.graphs = None
        if offloaded is not None:
            self._offloaded = offloaded
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if level >= 2 and self._released is None:
            self._released = {}
            for name, param in self.model.named_parameters():
                weights = param if self._offloaded is None else self._offloaded[name]  # on the host at level 1
                self._released[name] = (weights.shape, weights.dtype)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self._offloaded = None
        self._refresh()  # what the platform built over the caches (a fused decode stack) goes too
        self.parts.platform.release_memory()

    def wake_up(self, tags: list[str]) -> None:
        parts = self.parts
        if "weights" in tags and self._offloaded is not None:
            device = parts.platform.device_type
            for name, param in self.model.named_parameters():  # from pinned memory: queued, no wait each
                param.data = self._offloaded[name].to(device, non_blocking=True)
            self._offloaded = None
            # one wait for the copies, then the pinned blocks go back to the OS (torch's host
            # allocator would keep them page-locked, a copy of the weights, while the engine runs)
            parts.platform.record_event().synchronize()
            parts.platform.release_memory()
            self._refresh()
        if "weights" in tags and self._released is not None:
            device = parts.platform.device_type
            for name, param in self.model.named_parameters():
                shape, dtype = self._released[name]
                param.data = torch.empty(shape, dtype=dtype, device=device)
            with torch.no_grad():
                load_strictly(self.model, iterate_weights(parts.built.model_config.path, progress=False),
                              str(parts.built.model_config.path))
            self._released = None
            self._refresh()
        if "kv_cache" in tags and self._kv_released:
            swap = parts.built.allocate_caches(parts.config, parts.platform, parts.num_blocks, parts.num_host_blocks)
            parts.step.swap = swap if isinstance(swap, SwapCaches) else None
            self._kv_released = False
        awake = not self._kv_released and self._released is None and self._offloaded is None
        if awake and parts.record_graphs is not None and parts.step.graphs is None:
            parts.step.graphs = parts.record_graphs()  # over the weights' and caches' new addresses

    # --- profiling ------------------------------------------------------------
    def start_profile(self, directory: str) -> None:
        if self._profiler is not None:
            raise RuntimeError("a profile is already running: stop_profile first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.parts.platform.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        self._profile_dir = directory

    def stop_profile(self) -> str:
        """Stop the profile and write its Chrome trace; returns the file's path."""
        if self._profiler is None:
            raise RuntimeError("no profile is running: start_profile first")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = Path(self._profile_dir) / f"rank{self.parts.built.parallel.rank}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        return str(path)


def _public(cls: Any, attr: str) -> bool:
    return bool(attr) and not attr.startswith("_") and inspect.isfunction(getattr(cls, attr, None))

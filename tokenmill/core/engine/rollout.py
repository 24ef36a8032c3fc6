"""vLLM 0.32's training-loop API over one engine: worker RPCs, the weight-transfer cycle,
sleep and wake, the prefix cache's reset, profiling.

A training loop (TRL's GRPO, verl, OpenRLHF) generates rollouts, trains, pushes the new
weights and generates again, putting the engine to sleep while it trains. Every call here
runs between steps (the offline ``LLM`` is idle between calls; the server runs them on its
engine thread) and on every rank (ControlPlane).

Weight updates are checked whole on the driver before any rank receives a tensor: every
name must be one of the checkpoint's, with its shape, as a 16- or 32-bit float; a refused
update leaves the old weights as they were. ``finish_weight_update`` rebuilds what the
platform derived from the weights (packed copies, the greedy head, decode graphs) and
empties the prefix cache, whose blocks hold keys and values of the old weights.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import structlog
import torch

from tokenmill.core.engine.control_plane import ControlPlane
from tokenmill.core.model_loader.safetensors_files import checkpoint_shapes
from tokenmill.interfaces.errors import TokenmillError
from tokenmill.interfaces.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

log = structlog.get_logger("tokenmill.rollout")

#: what wake_up restores when no tags are given
ALL_TAGS = ("weights", "kv_cache")


class EngineAsleep(TokenmillError):
    """The engine sleeps (``sleep``): it takes no requests until ``wake_up``."""


class WeightsIncomplete(EngineAsleep):
    """A weight update failed midway: the weights may be part old, part new, so the engine
    takes no requests until an update succeeds and ``finish_weight_update`` is called."""


class EngineControl:
    def __init__(self, engine: Any, plane: ControlPlane) -> None:
        """``engine``: the LLMEngine this controls (which holds this object as ``control``)."""
        self.engine = engine
        self.plane = plane
        self.weight_version: Optional[str] = None
        #: what sleeps: "weights", "kv_cache" (empty while awake)
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self._checkpoint: Optional[dict[str, tuple[tuple[int, ...], str]]] = None
        self._transfer_ready = False
        #: after a failed update: "failed", then "resent" once an update succeeds ("ok" after finish)
        self._weights = "ok"

    # --- worker extensions ----------------------------------------------------
    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """``method`` of the registered worker extensions on every rank; the results in rank
        order. A callable (taking the WorkerContext first) runs only on a one-rank engine:
        nothing is pickled to reach another process."""
        if callable(method) and self.plane.world_size > 1:
            raise TypeError("a callable cannot reach worker processes (nothing is pickled): register a worker "
                            "extension and call its method by name")
        return self.plane.run("collective_rpc", {"method": method, "args": list(args), "kwargs": kwargs or {}},
                              timeout_s=timeout)

    # --- weight transfer --------------------------------------------------------
    def init_weight_transfer_engine(self, request: Union[WeightTransferInitRequest, dict]) -> None:
        config = self.engine.config
        if config.weight_transfer_config is None:
            raise ValueError("this engine takes no weight updates: build it with weight_transfer_config "
                             "(e.g. {'backend': 'in_process'} or {'backend': 'gloo'})")
        if self.engine.model_config.quantization_config or config.quantization.method:
            raise ValueError("weight updates into a quantized model are not supported: serve the trainer's "
                             "unquantized checkpoint")
        init_info = _field(request, "init_info")
        self.plane.run("init_weight_transfer", {"backend": config.weight_transfer_config.backend,
                                                "init_info": init_info})
        self._checkpoint = self._checkpoint or checkpoint_shapes(self.engine.model_config.path)
        self._transfer_ready = True
        log.info("weight transfer ready", backend=config.weight_transfer_config.backend)

    def start_weight_update(self) -> None:
        self._require_transfer()
        self.plane.run("start_weight_update", {})

    def update_weights(self, request: Union[WeightTransferUpdateRequest, dict]) -> None:
        """Receive one part of an update (call it as often as the transfer needs)."""
        self._require_transfer()
        update_info = dict(_field(request, "update_info"))
        local = None
        if "weights" in update_info:  # in_process: the tensors themselves, on rank 0
            weights = update_info.pop("weights")
            pairs = list(weights.items() if isinstance(weights, dict) else weights)
            if not all(isinstance(t, torch.Tensor) for _, t in pairs):
                raise ValueError("update_info['weights'] holds (name, tensor) pairs or a {name: tensor} dict")
            update_info = {"names": [n for n, _ in pairs],
                           "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
                           "shapes": [list(t.shape) for _, t in pairs]}
            local = {"update_info": {**update_info, "weights": pairs}}
        extra = set(update_info) - {"names", "dtype_names", "shapes"}
        if extra or not {"names", "dtype_names", "shapes"} <= set(update_info):
            raise ValueError("update_info takes names, dtype_names and shapes (or, in_process, weights); got "
                             + ", ".join(sorted(update_info)))
        check_update(update_info["names"], update_info["dtype_names"], update_info["shapes"], self._checkpoint)
        try:
            self.plane.run("update_weights", {"update_info": update_info}, local)
        except BaseException:  # some tensors may have been copied, on some ranks
            self._weights = "failed"
            raise
        if self._weights == "failed":
            self._weights = "resent"

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._require_transfer()
        self.plane.run("finish_weight_update", {})
        if self._weights == "resent":
            self._weights = "ok"
        self.weight_version = weight_version
        self.engine.scheduler.invalidate_prefix_cache()
        log.info("weights updated", weight_version=weight_version)

    def get_weight_version(self) -> Optional[str]:
        return self.weight_version

    def _require_transfer(self) -> None:
        if not self._transfer_ready:
            raise RuntimeError("call init_weight_transfer_engine first")
        if "weights" in self.asleep:
            raise EngineAsleep("the weights sleep (level 2): wake_up(['weights']) before updating them")

    # --- sleep ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache and moves a device's weights to host memory (the cpu
        platform's are there already); level 2 frees the weights too (the checkpoint's come
        back on wake_up, so the weight version is forgotten). Asleep already, the deeper of
        the two levels holds."""
        if not self.engine.config.enable_sleep_mode:
            raise ValueError("sleep needs enable_sleep_mode=True when the engine is built")
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: 1 (KV cache) or 2 (KV cache and weights)")
        if self.engine.has_unfinished_requests():
            raise RuntimeError("requests are running: let them finish (or abort them) before sleep")
        self.plane.run("sleep", {"level": level})
        self.engine.scheduler.kv_cache.pool.reset_prefix_cache()  # the blocks' contents are gone
        # at level 1 a device's weights go to host memory; the cpu platform's stay put
        on_host = self.engine.platform is None or self.engine.platform.device_type == "cpu"
        self.asleep |= {"kv_cache"} if level == 1 and on_host else set(ALL_TAGS)  # a second sleep: the deeper
        self.sleep_level = max(level, self.sleep_level)
        if level == 2:  # the checkpoint's weights come back on wake_up, not the trainer's (nor a failed update's)
            self.weight_version, self._weights = None, "ok"
        log.info("asleep", level=level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        tags = list(ALL_TAGS if tags is None else tags)
        unknown = set(tags) - set(ALL_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}: {', '.join(ALL_TAGS)}")
        if not self.asleep:
            return
        self.plane.run("wake_up", {"tags": tags})
        self.asleep -= set(tags)
        if not self.asleep:
            self.sleep_level = 0
        log.info("awake" if not self.asleep else "partly awake", still_asleep=sorted(self.asleep))

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self) -> None:
        if self.asleep:
            raise EngineAsleep(f"the engine is asleep (level {self.sleep_level}): wake_up first")
        if self._weights != "ok":
            raise WeightsIncomplete("a weight update failed midway, so the weights may be part old, part new: "
                                    "send the update again, then finish_weight_update")

    # --- prefix cache, profiling --------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while requests hold blocks."""
        return self.engine.scheduler.kv_cache.pool.reset_prefix_cache()

    def start_profile(self) -> None:
        profiler = self.engine.config.profiler_config
        if profiler is None:
            raise ValueError("set profiler_config (vLLM's: {'profiler': 'torch', 'torch_profiler_dir': DIR}) "
                             "to profile")
        self.plane.run("start_profile", {"directory": profiler.torch_profiler_dir})

    def stop_profile(self) -> list[str]:
        """Stop profiling; the Chrome trace each rank wrote."""
        return self.plane.run("stop_profile", {})


def check_update(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                 expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Refuse an update whose names, shapes or dtypes do not fit the checkpoint's."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(f"names, dtype_names and shapes differ in length ({len(names)}, {len(dtype_names)}, "
                         f"{len(shapes)})")
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise ValueError(f"no such weights in this model: {', '.join(unknown[:10])}"
                         + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
    for name, dtype, shape in zip(names, dtype_names, shapes):
        if tuple(shape) != expected[name][0]:
            raise ValueError(f"{name}: shape {list(shape)}, the model's is {list(expected[name][0])}")
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype) or not kind.is_floating_point or kind.itemsize == 1:
            raise ValueError(f"{name}: dtype {dtype!r} is not a 16- or 32-bit float")


def _field(request: Any, name: str) -> dict[str, Any]:
    """A request object's field (vLLM's dataclasses), or a dict's ``{name: {...}}``."""
    value = request.get(name, {}) if isinstance(request, dict) else getattr(request, name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict")
    return value

"""The Platform contract: what a kind of device decides for the engine.

A platform owns the answers that differ between a CPU, a GPU and a third
party's accelerator: whether it is usable here, which dtype ``dtype: auto``
means for a checkpoint, per-process setup (threads, allocator), the KV-cache
memory budget, the optimisation pass over a loaded model (prepacked weights,
fused ops, decode fast paths), an optional greedy argmax head, and host buffers
(swap space, input staging), recorded device work for decode steps (CUDA graphs) and the
memory a forward pass's activations take. The core asks; it never tests for a device itself.

A platform's options live in its own config section, ``platform.<name>``, validated by
its ``options_model`` (a pydantic model): ``platform: {name: cpu, cpu: {num_threads: 4}}``.

Platforms are registered through the ``register_platforms`` hook.
``platform.name: auto`` tries every registered platform's ``detect()`` and
takes the usable one with the highest ``priority``, logging why each other one
was passed over (at warning level only when none is usable); an explicit name that is unusable is an
error that gives the platform's reason. The defaults below are plain PyTorch
on the CPU, so a subclass overrides only what it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict

#: the KV cache's budget in host memory where ``cache.kv_cache_memory`` is not set
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


@dataclass(frozen=True)
class Detection:
    """``detect()``'s answer: usable here or not, and why, in words a user can act on."""

    usable: bool
    reason: str


class GreedyArgmax(Protocol):
    """Greedy tokens from the final hidden states without materialising every logit."""

    def tokens(self, hidden: torch.Tensor) -> Optional[list[int]]:
        """The argmax token per row of ``hidden``, or None to fall back to full logits."""


class DeviceGraph(Protocol):
    """Device work recorded once and launched again as a whole: the same kernels, on whatever
    their input buffers hold at the time."""

    def replay(self) -> None:
        """Launch the recorded work again."""


class DeviceEvent(Protocol):
    """A mark in the device's queue of work."""

    def synchronize(self) -> None:
        """Wait until the work queued before the mark is done (and none of what came after)."""


class NoOptions(BaseModel):
    """A platform without options: its section, if given, must be empty."""

    model_config = ConfigDict(extra="forbid")


class Platform:
    """One kind of device. Constructed once per engine, with the engine's config (``config``)
    and this platform's validated section of it (``options``)."""

    #: the name ``platform.name`` selects
    name: str = ""
    #: torch's device type for tensors the engine places
    device_type: str = "cpu"
    #: torch.distributed's backend for this device ("gloo", "nccl", ...)
    dist_backend: str = "gloo"
    #: with ``platform.name: auto``, the usable platform with the highest priority wins
    priority: int = 0
    #: the KV-cache budget leaves room for a forward pass's activations, measured by running
    #: one at startup (``peak_memory``); a platform whose budget is a configured number
    #: (the CPU's ``cache.kv_cache_memory``) skips that run
    profiles_memory: ClassVar[bool] = False
    #: validates the ``platform.<name>`` config section
    options_model: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, config: Any, options: Optional[BaseModel] = None) -> None:
        self.config = config
        self.options = options if options is not None else self.options_model()

    @classmethod
    def detect(cls) -> Detection:
        """Whether this platform can run here. Must not initialise the device (no CUDA context)."""
        return Detection(True, "PyTorch runs on the CPU everywhere")

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype ``dtype: auto`` gives a checkpoint stored in ``checkpoint_dtype``."""
        return checkpoint_dtype

    def setup_process(self, rank: int = 0) -> None:
        """Per-process setup before the model is built: threads, allocator settings, the
        device of this process's ``rank`` (the driver is rank 0)."""

    def kv_cache_memory(self, requested: Optional[int], activation_bytes: int = 0) -> int:
        """The bytes the KV cache may use, given the configured ``cache.kv_cache_memory`` (None:
        not configured) and, where the platform ``profiles_memory``, the peak a forward pass's
        activations reached."""
        return DEFAULT_KV_CACHE_MEMORY if requested is None else requested

    def peak_memory(self, run: Callable[[], None]) -> int:
        """Bytes the device's allocator held at its peak during ``run`` beyond what it held
        before. Asked only where the platform ``profiles_memory``."""
        run()
        return 0

    def capture_graph(self, run: Callable[[], None]) -> Optional[DeviceGraph]:
        """``run``'s device work recorded for replay (after a warm-up run), or None where the
        platform has no such graphs and decode steps launch their kernels one by one. Every
        graph of an engine shares one memory pool: they are never replayed at once."""
        return None

    def is_fatal_error(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a step, leaves the device unusable, so that no request
        can run again in this process (the engine then stops rather than failing only the
        step's requests). An accelerator's error is, by default: torch raises
        ``AcceleratorError`` for the device runtime's errors, and CUDA's are sticky. Running
        out of memory is not (``OutOfMemoryError``): that step's requests fail, the engine goes on."""
        return isinstance(error, getattr(torch, "AcceleratorError", ()))

    def custom_op(self, layer: torch.nn.Module) -> Optional[Callable[..., Any]]:
        """This platform's implementation of the op ``layer.op_name`` names (a
        ``tokenmill.core.layers.custom_op.CustomOp``), called as ``impl(layer, *args)``; None
        keeps the layer's ``forward_native``. Asked once per layer whose op
        ``compilation_config.custom_ops`` leaves on."""
        return None

    def optimize_model(self, model: torch.nn.Module) -> None:
        """The optimisation pass over a loaded model, after the custom ops are dispatched
        (prepacked weights, a ``fused_decoder`` for ``FusableDecoder`` stacks). Not called
        under ``compilation_config.custom_ops: ["none"]``, so the plain PyTorch model stays the reference."""

    def place_model(self, model: torch.nn.Module) -> None:
        """Where the loaded (and optimised) weights live: a device, huge pages, ..."""

    def release_memory(self) -> None:
        """Hand memory freed by the process back to the system or device (once the engine is
        built, and after sleep frees the KV cache or the weights), so that the release
        shows: the allocator's caches."""

    def refresh_weights(self, model: torch.nn.Module) -> None:
        """The weights changed in place (a trainer's update, a wake from sleep) or were
        released (empty parameters: sleep level 2): rebuild, or drop, every copy
        ``optimize_model`` derived from them. It is only called on a model built with
        ``keeps_plain_weights`` set, which ``optimize_model`` must honour: each layer keeps
        its parameters (the same objects, dtypes and shapes) as the loader wrote them, for
        updates to write into again. Recorded decode graphs are kept across a refresh where
        no tensor reachable from the model's modules (parameters, buffers, tensor attributes)
        moved: a copy derived here that a graph reads must be one of those."""

    def greedy_head(self, model: torch.nn.Module) -> Optional[GreedyArgmax]:
        """An argmax head for steps whose rows are all greedy without logprobs, or None."""
        return None

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed host memory for swap space and input staging (pinned, on a GPU platform)."""
        return torch.zeros(tuple(shape), dtype=dtype)

    def noise_generator(self, seed: int) -> Optional[torch.Generator]:
        """A generator on the device the logits are on, for the random noise that sampled rows
        draw (the engine's, seeded with its seed, and a seeded request's own); None draws it
        with host generators and copies it there (on the CPU, where there is no copy). Drawn on
        the host, the noise is a [rows, vocab] copy to the device each step (32 MB at 256 rows
        of a 32k vocabulary), and a seeded row's draw a host loop over the vocabulary (5-13 ms
        at 152k)."""
        return None

    def record_event(self) -> DeviceEvent:
        """A mark after the work queued on the device so far: the host reads a step's sampled
        tokens once its mark is passed, not once everything queued after it is done too
        (async scheduling queues the next step first). Asked only where the model runs on a
        device that is not the host."""
        raise NotImplementedError(f"the {self.name} platform records no device events")

    def describe(self) -> dict[str, Any]:
        """What the engine's startup log says about this platform."""
        return {"platform": self.name, "device": self.device_type}

"""The AdapterType contract (LoRA today): per-request weight deltas in a mixed batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the contracts does not import torch
    import torch


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for "run this request with that adapter"."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@runtime_checkable
class AdapterType(Protocol):
    """Loads adapters and adds their deltas to the linear layers they target.

    Lifecycle: the engine builds it once, calls ``attach(model)`` after the base
    weights are loaded, then, every step, ``prepare_step`` with each scheduled
    request's adapter before the forward pass. ``load``/``unload`` may be
    called between steps (the engine thread serialises them with steps).
    """

    name: str
    #: distinct adapters one step may use (vLLM's max_loras)
    max_active: int
    #: set by the engine: whether a live request uses the named adapter (never evict those)
    in_use: Callable[[str], bool]
    #: set by the engine: zeroed host memory of a shape and dtype (the
    #: platform's ``host_buffer``: pinned on a GPU, so weights cross to the device without a wait)
    host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor]

    def attach(self, model: torch.nn.Module) -> None:
        """Hook into the model's supported linear layers."""

    def load(self, name: str, path: str) -> None:
        """Load an adapter; unsupported features fail here with a list, never mid-request."""

    def unload(self, name: str) -> None: ...

    def loaded(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""

    def prepare_step(self, adapters: Sequence[Optional[str]], query_lens: Sequence[int]) -> None:
        """Per-token adapter slots for the next forward: request ``i`` has ``query_lens[i]``
        tokens and adapter ``adapters[i]`` (None = base model only)."""

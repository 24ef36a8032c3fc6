"""A step's inputs, assembled on the host and copied to the device in one non-blocking copy each.

The host side is one persistent buffer per input (token ids, positions, the attention
metadata's arrays), from the platform's ``host_buffer``: pinned memory on a GPU, so each
copy is a DMA that overlaps with the host's work instead of a synchronous, pageable copy.
A buffer is reused by a later step once the host has read the result of the step that
filled it, which waits for that step's copies: the next step where every step's result is
read before the next is launched, the one after it under async scheduling (``sets=2``:
buffers taking turns, ``next_step`` at each step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from tokenmill.interfaces.platform import Platform


class InputStaging:
    def __init__(self, device: str, host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor],
                 sets: int = 1) -> None:
        self.device = device
        self._host_buffer = host_buffer
        self._sets: list[dict[str, torch.Tensor]] = [{} for _ in range(sets)]
        self._buffers = self._sets[0]
        self._turn = 0

    @classmethod
    def for_platform(cls, platform: Platform, sets: int = 1) -> "InputStaging | None":
        """Staging for a platform whose device is not the host; None where the model runs on it."""
        return None if platform.device_type == "cpu" else cls(platform.device_type, platform.host_buffer, sets)

    def next_step(self) -> None:
        """A new step stages its inputs: in the next set of buffers."""
        self._turn = (self._turn + 1) % len(self._sets)
        self._buffers = self._sets[self._turn]

    def to_device(self, name: str, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device, through the host buffer ``name`` (grown as needed)."""
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < tensor.numel() or buffer.dtype != tensor.dtype:
            size = max(tensor.numel(), 2 * buffer.numel() if buffer is not None else 0, 1)
            buffer = self._buffers[name] = self._host_buffer((size,), tensor.dtype)
        staged = buffer[:tensor.numel()].view(tensor.shape)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)

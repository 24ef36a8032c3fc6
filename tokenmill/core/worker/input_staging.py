"""A step's inputs, assembled on the host and copied to the device in one non-blocking copy each.

The host side is one persistent buffer per input (token ids, positions, the attention
metadata's arrays), from the platform's ``host_buffer``: pinned memory on a GPU, so each
copy is a DMA that overlaps with the host's work instead of a synchronous, pageable copy.
A buffer is reused by the next step; that is safe because every step ends by reading its
result on the host, which waits for the step's copies and kernels to finish.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from tokenmill.interfaces.platform import Platform


class InputStaging:
    def __init__(self, device: str, host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        self.device = device
        self._host_buffer = host_buffer
        self._buffers: dict[str, torch.Tensor] = {}

    @classmethod
    def for_platform(cls, platform: Platform) -> "InputStaging | None":
        """Staging for a platform whose device is not the host; None where the model runs on it."""
        return None if platform.device_type == "cpu" else cls(platform.device_type, platform.host_buffer)

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

"""Device faults on request, for the tests of what the engine and server do when the device
breaks: a logits processor (``logits_processors: ["tokenmill.testing.device_faults:DeviceFault"]``)
that breaks the device in the step of a request asking for it with
``extra_args={"device_fault": KIND}`` (``vllm_xargs`` on the wire):

- ``illegal_address``: on a GPU, a kernel that writes far outside its tensor (CUDA's
  illegal address, which poisons the process's context); on the CPU, the
  ``torch.AcceleratorError`` torch raises for one;
- ``oom``: on a GPU, an allocation larger than the device; on the CPU, the
  ``torch.OutOfMemoryError`` torch raises for one.
"""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.interfaces.logits_processor import BatchUpdate, LogitsProcessor
from tokenmill.interfaces.sampling_params import SamplingParams

KINDS = ("illegal_address", "oom")


class DeviceFault(LogitsProcessor):
    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        kind = (params.extra_args or {}).get("device_fault")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"device_fault must be one of {KINDS}, got {kind!r}")

    def __init__(self, context) -> None:
        super().__init__(context)
        self.rows: dict[int, str] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # runs for greedy rows too

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self.rows, lambda row: (row.params.extra_args or {}).get("device_fault"))

    def is_active(self) -> bool:
        return any(kind is not None for kind in self.rows.values())

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        kinds = set(self.rows.values())
        if "illegal_address" in kinds:
            illegal_address(logits)
        if "oom" in kinds:
            out_of_memory(logits.device)
        return logits


def illegal_address(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cuda":
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (a CPU stand-in)")
    import triton
    import triton.language as tl

    @triton.jit
    def write_far(ptr):
        tl.store(ptr + (1 << 40), 1.0)

    write_far[(1,)](tensor)
    torch.cuda.synchronize()


def out_of_memory(device: torch.device) -> None:
    if device.type != "cuda":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 GiB (a CPU stand-in)")
    torch.empty(1 << 40, dtype=torch.uint8, device=device)

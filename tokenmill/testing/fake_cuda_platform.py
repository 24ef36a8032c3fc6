"""The cuda platform on the stand-in device (``fake_cuda``), for the CPU suite's device nets.

``FakeCudaPlatform`` is ``CudaPlatform`` itself (device placement, pinned host buffers,
the profiling forward pass, the Triton fused-MoE op, dtype rules), less the calls into
the CUDA runtime, which a CPU-only torch lacks: memory figures come from the config
(``cache.kv_cache_memory``), the profiling pass's peak is not measured (its wait for the
device is kept: the stand-in's queue of pinned copies drains there too), and decode steps
are recorded by the faithful graph stand-in (``device_graphs.record``) instead of
``torch.cuda.CUDAGraph``. Use it inside ``fake_cuda()``, with the Triton attention backend
in the interpreter.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from tokenmill.interfaces.platform import Detection, Platform
from tokenmill.plugins.platforms.cuda.platform import CudaPlatform
from tokenmill.testing.device_graphs import RecordsGraphs
from tokenmill.testing.device_memory import DEVICE_MEMORY
from tokenmill.testing.device_queue import queue_mark, synced, wait_for_mark
from tokenmill.testing.fake_cuda import device_generator


class FakeCudaPlatform(RecordsGraphs, CudaPlatform):
    name = "fake-cuda"
    priority = -1  # chosen only by name

    def __init__(self, config, options=None) -> None:
        super().__init__(config, options)
        #: the device memory each profiling pass peaked at (bytes above what was held before)
        self.peaks: list[int] = []

    @classmethod
    def detect(cls) -> Detection:
        return Detection(True, "the CUDA stand-in on the CPU (tokenmill.testing.fake_cuda)")

    def setup_process(self, rank: int = 0) -> None:
        """No device to pick and no memory to read."""

    def kv_cache_memory(self, requested: Optional[int], activation_bytes: int = 0) -> int:
        """The configured budget, as a host platform's: the stand-in's device has no memory to read."""
        return Platform.kv_cache_memory(self, requested, activation_bytes)

    def bf16_supported(self) -> bool:
        return True  # it stands for an sm_80+ GPU

    def place_model(self, model: torch.nn.Module) -> None:
        """A model made on the device stays as it is, as on a GPU, where ``Module.to`` keeps each
        parameter object (and so its ``weight_loader``, which sleep's reload and a trainer's
        updates load through); the stand-in's ``to`` would wrap every parameter anew."""
        if any(t.device.type != "cuda" for t in itertools.chain(model.parameters(), model.buffers())):
            super().place_model(model)

    def peak_memory(self, run: Callable[[], None]) -> int:
        """As ``CudaPlatform``'s, over the stand-in's device memory; the KV budget is
        ``kv_cache_memory_bytes`` all the same (``peaks`` keeps each measure)."""
        before = DEVICE_MEMORY.allocated
        DEVICE_MEMORY.reset_peak()
        run()
        synced("torch.cuda.synchronize() after the profiling forward")  # as CudaPlatform's
        self.peaks.append(max(0, DEVICE_MEMORY.peak - before))
        return self.peaks[-1]

    def describe(self) -> dict:
        return {"platform": self.name, "device": self.device_type}

    def noise_generator(self, seed: int) -> torch.Generator:
        return device_generator(seed)

    def record_event(self) -> "StandInEvent":
        return StandInEvent()


class StandInEvent:
    """A mark in the stand-in's queue of copies: waiting for it (``host_syncs``: a wait, unless
    the host knows the device passed it) lets the pinned buffers copied before it be written."""

    def __init__(self) -> None:
        self.mark = queue_mark()

    def synchronize(self) -> None:
        wait_for_mark(self.mark)

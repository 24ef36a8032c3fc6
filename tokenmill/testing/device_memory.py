"""Device memory on the CUDA stand-in, counted as ``torch.cuda.memory_allocated`` and
``max_memory_allocated`` count it: the bytes of the storages that device tensors hold, now and
at their peak. With it, the stand-in's ``peak_memory`` measures a profiling pass as the cuda
platform's does, so a step the profile leaves out (one that would run out of memory on a GPU
whose KV cache filled the rest) shows here as a step whose peak passes the profiled one.

A storage counts from the first device tensor over it until the last one is collected (views
share it); the host tensor inside a device tensor is the stand-in's business, not the engine's.
"""

from __future__ import annotations

import threading
import weakref

import torch


class DeviceMemory:
    def __init__(self) -> None:
        # re-entrant: an allocation under the lock may collect a device tensor, whose release
        # then takes the lock on the same thread
        self._lock = threading.RLock()
        #: storage address -> [bytes, device tensors over it]
        self._storages: dict[int, list[int]] = {}
        self.allocated = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor, elem: torch.Tensor) -> weakref.finalize:
        """Count ``elem``'s storage while the device tensor ``tensor`` lives (or until the
        returned finalizer is called: ``tensor`` holds another storage from then on)."""
        storage = elem.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                entry = self._storages[key] = [storage.nbytes(), 0]
                self.allocated += entry[0]
                self.peak = max(self.peak, self.allocated)
            entry[1] += 1
        return weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._storages[key]
                self.allocated -= entry[0]

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated


#: the stand-in device's memory (one device per process, as ``cuda:0``)
DEVICE_MEMORY = DeviceMemory()

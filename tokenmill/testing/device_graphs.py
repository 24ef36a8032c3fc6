"""A stand-in for CUDA graphs, so the decode-graph path runs on a machine without a GPU.

``RecordingPlatform`` is the plain-PyTorch platform with ``capture_graph``: it runs the
function once under ``HostSyncCheck`` (what CUDA's stream capture would refuse: a value
read back to the host, or a tensor whose shape depends on values) and returns a
``ReplayedGraph``, which runs the same function again on each replay. The function
closes over the same buffers, metadata and output as a real recording would, so a step
that forgot to refill a buffer, a padding row that wrote KV, or a bucket whose grid was
fixed for another size gives wrong tokens here as it would on the GPU.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from tokenmill.interfaces.platform import DeviceGraph, Platform

#: Tensor methods and functions that wait for the device or size their output by its values
_HOST_SYNCS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "nonzero",
                         "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})


class HostSyncError(RuntimeError):
    """An operation that cannot be recorded in a device graph ran inside one."""


class HostSyncCheck(TorchFunctionMode):
    """Raises ``HostSyncError`` on host synchronisation in the code it wraps (kernel launch
    machinery, such as Triton's interpreter, excepted: a GPU launch does not read back)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in _HOST_SYNCS or _bool_indexing(name, args)
                or (name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                               torch.Tensor) and "output_size" not in kwargs)):
            if not _called_from_triton():
                raise HostSyncError(f"{name} synchronises with the host inside a recorded graph")
        return func(*args, **kwargs)


def _bool_indexing(name: str, args: tuple) -> bool:
    if name not in ("__getitem__", "__setitem__", "index_put_", "index_put") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _called_from_triton() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton"):
            return True
        if module.startswith("tokenmill"):
            return False
        frame = frame.f_back
    return False


class ReplayedGraph:
    """A "recording" that runs its function again on each replay; counts its replays."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with HostSyncCheck():
            self.run()


class RecordingPlatform(Platform):
    """Plain PyTorch on the CPU, with decode graphs through ``ReplayedGraph``."""

    name = "cpu-graphs"
    priority = -1  # chosen only by name

    def __init__(self, config, options=None) -> None:
        super().__init__(config, options)
        #: every graph captured, in order
        self.graphs: list[ReplayedGraph] = []

    def capture_graph(self, run: Callable[[], None]) -> Optional[DeviceGraph]:
        with HostSyncCheck():
            run()  # the recording run: the same kernels a replay launches
        graph = ReplayedGraph(run)
        self.graphs.append(graph)
        return graph

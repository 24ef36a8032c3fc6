"""A faithful stand-in for CUDA graphs, so the decode-graph path is checked on a machine
without a GPU.

A CUDA graph records the kernels a stream launched, each with its grid, its scalar
arguments and its tensors' addresses as they were at capture; a replay launches exactly
those again and runs no Python. ``record(run)`` does the same on the CPU: it runs ``run``
once under a dispatch mode that records every aten operation (with its arguments) and every
interpreted Triton launch (``kernel_launches``), and returns a ``RecordedGraph`` whose
``replay`` re-issues them on the same tensors. So, as on a GPU:

- a value read on the host at capture (a Python number, a host 0-dim tensor) stays the one
  captured;
- a tensor made during the recording belongs to the graph (CUDA's graph memory pool): the
  graph keeps it, and each replay rewrites it in place;
- a tensor made before the recording is only referenced: the graph holds no reference to it.
  If its memory is freed after capture, a replay reads freed memory. On a GPU that is an
  illegal address or garbage; here it raises ``FreedTensorError``, naming the operation;
- what stream capture refuses is refused while recording (``HostSyncError``): reading a
  value back to the host, an operation whose output's size depends on values, a copy
  between host and device.

``run`` itself is not kept: a caller must keep alive what its recorded work reads, as with
``torch.cuda.CUDAGraph``.

``RecordingPlatform`` is plain PyTorch on the CPU with ``capture_graph`` through ``record``.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tokenmill.interfaces.platform import DeviceGraph, Platform
from tokenmill.testing import kernel_launches
from tokenmill.testing.device_waits import waits
from tokenmill.testing.fake_cuda import DeviceTensor

aten = torch.ops.aten

#: Tensor methods and functions that wait for the device or size their output by its values
_HOST_SYNCS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "nonzero",
                         "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})

class HostSyncError(RuntimeError):
    """An operation that cannot be recorded in a device graph ran inside one."""


class FreedTensorError(RuntimeError):
    """A replayed graph read a tensor whose memory was freed after it was recorded."""


class HostSyncCheck(TorchFunctionMode):
    """Raises ``HostSyncError`` on host synchronisation in the code it wraps (kernel launch
    machinery, such as Triton's interpreter, excepted: a GPU launch does not read back).
    Function-level: it also sees ``.tolist()`` and ``.numpy()`` of host tensors, which reach no
    aten operation."""

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
    index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _called_from_triton() -> bool:
    if kernel_launches.in_launch():
        return True
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton"):
            return True
        if module.startswith("tokenmill"):
            return False
        frame = frame.f_back
    return False


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The memory holding ``tensor``'s values (for a device tensor, its host twin's): one
    object per allocation, alive while any tensor uses it."""
    return (tensor.elem if isinstance(tensor, DeviceTensor) else tensor).untyped_storage()


@dataclass(frozen=True)
class _External:
    """A tensor made before the recording: a weak reference to its memory and the view's
    geometry, as a CUDA graph holds an address and no reference."""

    storage: weakref.ref
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    on_device: bool
    what: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_External":
        return cls(weakref.ref(_storage(tensor)), tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.storage_offset(), tensor.dtype, isinstance(tensor, DeviceTensor),
                   f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}")

    def resolve(self, where: str) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            raise FreedTensorError(f"replay of {where} reads a tensor ({self.what}) that was made before the "
                                   "recording and freed after it: on a GPU that is an illegal address or garbage")
        view = torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)
        return DeviceTensor(view) if self.on_device else view


@dataclass(frozen=True)
class _Op:
    """One recorded aten operation, and the outputs it allocated (by position)."""

    func: Any
    args: Any
    kwargs: Any
    fresh: dict[int, torch.Tensor]


@dataclass(frozen=True)
class _Kernel:
    """One recorded Triton launch."""

    kernel: Any
    grid: Any
    args: Any
    kwargs: Any


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.launches: list[Any] = []
        #: tensors allocated during the recording (CUDA's graph pool: the graph keeps them)
        self.pool: list[torch.Tensor] = []
        #: ids of the pool's memory (the storages stay alive while ``pool`` holds them)
        self._owned: set[int] = set()

    def reference(self, value: Any) -> Any:
        """Tensors in the graph's memory by reference; a host scalar (0-dim) by its value, as
        CUDA passes one to a kernel; any other tensor by address only."""

        def one(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or id(_storage(x)) in self._owned:
                return x
            if x.dim() == 0 and not isinstance(x, DeviceTensor):
                return x.clone()
            return _External.of(x)

        return tree_map(one, value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kernel_launches.in_launch():  # the interpreter's own host copies
            return func(*args, **kwargs)
        _refuse_unrecordable(func, args, kwargs)
        out = func(*args, **kwargs)
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        # an output in memory no input has is new (views and in-place results are not)
        inputs = {id(_storage(x)) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        fresh = {i: value for i, value in enumerate(outputs)
                 if isinstance(value, torch.Tensor) and id(_storage(value)) not in inputs}
        self.launches.append(_Op(func, self.reference(args), self.reference(kwargs), fresh))
        for value in fresh.values():
            self.pool.append(value)
            self._owned.add(id(_storage(value)))
        return out

    def triton(self, kernel: Any, grid: Any, args: tuple, kwargs: dict,
               launch: kernel_launches.Launch) -> Any:
        self.launches.append(_Kernel(kernel, grid, self.reference(args), self.reference(kwargs)))
        return launch(args, kwargs)


def _refuse_unrecordable(func: Any, args: tuple, kwargs: dict) -> None:
    name = str(func)
    if waits(func, args, kwargs):
        raise HostSyncError(f"{name} synchronises with the host (a value read back, or an output sized by values) "
                            "inside a recorded graph")
    if func in (aten._to_copy.default, aten.copy_.default):
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        kinds = {isinstance(t, DeviceTensor) for t in tensors}
        target = kwargs.get("device")
        if target is not None:
            kinds.add(torch.device(target).type == "cuda")
        if len(kinds) > 1:
            raise HostSyncError(f"{name} copies between host and device inside a recorded graph (stage inputs "
                                "before the replay; a host tensor made at capture is gone at replay)")


class RecordedGraph:
    """The recorded work of one ``record`` call; counts its replays."""

    def __init__(self, launches: list[Any], pool: list[torch.Tensor]) -> None:
        self._launches = launches
        self._pool = pool  # kept: the graph owns the memory made while recording
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for index, launch in enumerate(self._launches):
            where = f"launch {index} ({launch.func if isinstance(launch, _Op) else launch.kernel.__name__})"
            args, kwargs = _resolve(launch.args, where), _resolve(launch.kwargs, where)
            if isinstance(launch, _Kernel):
                kernel_launches.launch(launch.kernel, launch.grid, args, kwargs)
                continue
            out = launch.func(*args, **kwargs)
            if launch.fresh:  # the kernel writes into the memory recorded for its output
                results = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                for i, recorded in launch.fresh.items():
                    recorded.copy_(results[i])


def _resolve(value: Any, where: str) -> Any:
    return tree_map(lambda x: x.resolve(where) if isinstance(x, _External) else x, value)


def record(run: Callable[[], None]) -> RecordedGraph:
    """``run``'s work, recorded for replay (the caller has run it once already, as a warm-up)."""
    recorder = _Recorder()
    with HostSyncCheck(), kernel_launches.intercept_launches(recorder.triton), recorder:
        run()
    return RecordedGraph(recorder.launches, recorder.pool)


class RecordsGraphs:
    """A platform's ``capture_graph`` through ``record`` (a mixin, before the platform class):
    a warm-up run, as on CUDA, then the recording; every graph kept in ``graphs``, in order."""

    graphs: list[RecordedGraph]

    def __init__(self, config, options=None) -> None:
        super().__init__(config, options)
        self.graphs = []

    def capture_graph(self, run: Callable[[], None]) -> Optional[DeviceGraph]:
        run()
        graph = record(run)
        self.graphs.append(graph)
        return graph


class RecordingPlatform(RecordsGraphs, Platform):
    """Plain PyTorch on the CPU, with decode graphs recorded by ``record``."""

    name = "cpu-graphs"
    priority = -1  # chosen only by name

"""A CUDA device on the CPU, for the device-boundary net: tensors that say they are on
``cuda``, hold real values in host memory, and refuse to meet host tensors where CUDA would.

On a CPU-only machine, host and "device" tensors are the same kind, so code that hands a
host tensor to a device kernel (token ids that skipped the staging copy, a host tensor of
repeats beside a device scale) runs and passes; on a GPU it raises "Expected all tensors
to be on the same device". Under ``fake_cuda()``:

- ``device="cuda"`` (a factory's argument, ``torch.device("cuda")`` as a context,
  ``.to("cuda")``, ``.cuda()``, ``Module.to``) gives a ``DeviceTensor``: ``device`` is
  ``cuda:0``, the values live in a host tensor inside it, so the engine computes real tokens;
- every aten operation checks its tensors' devices as CUDA's kernels do (``check_devices``):
  one device per operation, except host 0-dim tensors (scalars to a CUDA kernel), the
  copies between devices, and host index tensors in indexing (CUDA moves those itself);
- a Triton kernel gets the device tensors' memory and refuses a host tensor, with Triton's
  own message; ``.numpy()`` of a device tensor fails as on a GPU;
- ``torch._scaled_mm`` refuses sizes cuBLASLt's FP8 GEMM refuses (``check_fp8_gemm``);
- ``pin_memory=True`` gives ordinary host memory (what pinning changes is only speed);
- a non-blocking copy out of (or into) pinned memory runs when the device's queue reaches
  it: the stand-in keeps the queue's order (``pinned_copies``) and raises ``PinnedBufferRace``
  where the host writes such a buffer before it knows the copy ran (on a GPU the copy would
  carry the new values, a later step's inputs); a copy into it lands only when the host
  waits past it (an event, a read back), so a read before that sees the old values. Into
  pageable memory such a copy returns once it landed: a wait.

Values are real, so an engine on ``FakeCudaPlatform`` can be compared with Hugging Face.
What it does not model: kernels running late (every kernel completes at once), memory
limits (it counts what device tensors hold: ``device_memory``), and the address-level faults
of recorded graphs (``device_graphs`` has those).
What it records instead (``device_queue.host_syncs()``): each point where a GPU's host would wait for the
device, so that code meant to run ahead of the device (async scheduling) can be held to it;
and (``device_queue.host_to_device_copies()``) the shape of each host tensor copied to the device.
Why a tensor subclass and not ``FakeTensorMode``: fake tensors have no values (the engine
could not sample), and on a CPU-only build their ``.to("cuda")``, cross-device
``copy_``, host-index indexing and pinning all raise although each is legal on a GPU.
"""

from __future__ import annotations

import copy
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from tokenmill.testing.device_memory import DEVICE_MEMORY
from tokenmill.testing.device_queue import copied_to_device, queue, reset_queue, synced
from tokenmill.testing.device_waits import INDEXING, waits
from tokenmill.testing.kernel_launches import intercept_launches

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten

#: operations whose tensors may sit on two devices: copies between them
_COPIES = frozenset({aten.copy_.default, aten._to_copy.default, aten._foreach_copy.default,
                     aten._foreach_copy_.default, aten.lift_fresh.default, aten.detach.default})


class DeviceMismatchError(RuntimeError):
    """A host tensor met a device tensor in an operation CUDA refuses."""


class DeviceTensor(torch.Tensor):
    """A tensor on ``cuda:0`` whose values are the host tensor ``elem``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "DeviceTensor":
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device=CUDA, requires_grad=elem.requires_grad)
        tensor.elem = elem
        tensor.held = DEVICE_MEMORY.hold(tensor, elem)
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``param.data = other`` as on a device: the tensor takes the other's values and storage,
        and its old storage is freed once nothing else holds it (sleep mode moves weights so)."""
        if not isinstance(value, DeviceTensor):
            raise DeviceMismatchError("a device tensor's .data set to a host tensor")
        torch._C.TensorBase.data.__set__(self, value)
        self.held()  # this tensor's hold on its old storage, ended now
        self.elem, self.held = value.elem, DEVICE_MEMORY.hold(self, value.elem)

    def data_ptr(self) -> int:
        """The address of its values, each tensor's own as on a device (a wrapper's is 0 for every
        tensor, so code telling tensors apart by address, as a recorded graph does, would see none move)."""
        return self.elem.data_ptr()

    def __deepcopy__(self, memo: dict) -> "DeviceTensor":
        """A device tensor with a copy of the values (torch's own deepcopy takes a tensor with an
        address for a real CUDA one, which the stand-in cannot make); a parameter stays one."""
        if id(self) not in memo:
            copied = DeviceTensor(copy.deepcopy(self.elem, memo))
            memo[id(self)] = (torch.nn.Parameter(copied, self.requires_grad)
                              if isinstance(self, torch.nn.Parameter) else copied)
        return memo[id(self)]

    def __repr__(self) -> str:
        synced("printing a device tensor")  # its values are read back
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_devices(func, args, kwargs)
        check_fp8_gemm(func, args)
        if waits(func, args, kwargs):
            synced(f"{func} of a device tensor (a value read back, or an output sized by its values)")
        to_device = _wants_device(kwargs)
        if to_device is None and any(isinstance(a, torch.device) for a in args):  # aten.to.device
            to_device = next(a for a in args if isinstance(a, torch.device)).type == "cuda"
            args = tuple(torch.device("cpu") if isinstance(a, torch.device) else a for a in args)
        if to_device is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs
        out = func(*tree_map(host_value, args), **tree_map(host_value, kwargs))
        if to_device is False:
            return out  # to the host (``_to_copy``, ``to.dtype_layout``, ...): a plain tensor
        if func in (aten.copy_.default, aten._foreach_copy_.default):
            return args[0]
        return _wrap(out)


def _wrap(out: Any) -> Any:
    """Device tensors around an operation's host results. Made outside inference mode: a view
    of a parameter taken in inference mode shares the parameter's version counter, which an
    inference-mode wrapper cannot (a plain CUDA view has no such wrapper)."""
    with torch.inference_mode(False):
        return tree_map(lambda x: DeviceTensor(x) if isinstance(x, torch.Tensor) else x, out)


def host_value(x: Any) -> Any:
    """The host tensor holding a device tensor's values; anything else as it is."""
    return x.elem if isinstance(x, DeviceTensor) else x


def _device_of(x: torch.Tensor) -> str:
    return "cuda" if isinstance(x, DeviceTensor) else x.device.type


def _wants_device(kwargs: dict) -> Optional[bool]:
    """True where ``kwargs`` names a cuda device, False for another one, None for none."""
    device = kwargs.get("device")
    if device is None:
        return None
    return torch.device(device).type == "cuda"


def check_devices(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise ``DeviceMismatchError`` where CUDA's kernel for ``func`` would refuse its tensors."""
    if func in _COPIES:
        return
    if func in INDEXING:  # CUDA moves host index tensors to the device itself (self and values must match)
        tensors = [args[0]] + [a for a in args[2:] if isinstance(a, torch.Tensor)]
    else:
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    devices = {_device_of(t) for t in tensors if not (t.dim() == 0 and _device_of(t) == "cpu")}
    if len(devices) > 1:
        found = ", ".join(sorted(devices))
        shapes = ", ".join(f"{_device_of(t)}{tuple(t.shape)}" for t in tensors)
        raise DeviceMismatchError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                  f"{found}! ({func}: {shapes})")


def check_fp8_gemm(func: Any, args: tuple) -> None:
    """cuBLASLt's FP8 GEMM (``torch._scaled_mm``) takes each dimension in multiples of 16 (the
    CPU's any): on an H200 it refused a one-token product (CUBLAS_STATUS_NOT_SUPPORTED, m 64
    n 1 k 128). The stand-in refuses every size that is not such a multiple."""
    if func is aten._scaled_mm.default:
        a, b = args[0], args[1]
        sizes = (a.shape[0], a.shape[1], b.shape[1])
        if any(size % 16 for size in sizes):
            raise RuntimeError(f"CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul: an FP8 "
                               f"product of {sizes[0]} x {sizes[1]} by {sizes[1]} x {sizes[2]} (each a multiple "
                               "of 16 on a GPU)")


def _to(func: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` across the boundary: to cuda wraps, to the host unwraps (a copy)."""
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is None:  # a dtype change stays where it is
        if not isinstance(tensor, DeviceTensor):
            return func(tensor, *args, **kwargs)
        device = CUDA
    options: dict[str, Any] = {"dtype": dtype or tensor.dtype}
    if memory_format is not None:
        options["memory_format"] = memory_format
    if device.type == "cuda":
        if isinstance(tensor, DeviceTensor):
            moved = tensor.elem.to(**options, copy=bool(kwargs.get("copy")))
            return tensor if moved is tensor.elem else DeviceTensor(moved)
        if non_blocking:
            queue().copied(tensor)
        else:
            synced(f"blocking copy of a host tensor {tuple(tensor.shape)} to the device")
        copied_to_device(tensor)
        return DeviceTensor(tensor.to(**options, copy=True))
    if isinstance(tensor, DeviceTensor):
        values = tensor.elem.to(device, **options, copy=True)
        if non_blocking:  # CUDA's result is pinned memory the copy lands in later
            landing = queue().pin(torch.empty_like(values))
            queue().copied_to_host(landing, values)
            return landing
        synced(f"copy of a device tensor {tuple(tensor.shape)} to the host")
        return values
    return func(tensor, *args, **kwargs)


#: the generators that stand for the device's (``device_generator``)
_DEVICE_GENERATORS: "weakref.WeakSet[torch.Generator]" = weakref.WeakSet()


def device_generator(seed: int) -> torch.Generator:
    """A generator of the stand-in device, as ``torch.Generator(device="cuda")`` is: it draws
    into device tensors only (its draws are a host generator's, into their host values)."""
    generator = torch.Generator().manual_seed(seed)
    _DEVICE_GENERATORS.add(generator)
    return generator


class _Placement(TorchFunctionMode):
    """The Python-level calls CPU-only torch refuses for ``cuda`` before any operation runs:
    factories and conversions that name the device, pinning, indexing a device tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        generator = kwargs.get("generator")
        if generator is not None:
            wanted = "cuda" if _wants_device(kwargs) or any(isinstance(x, DeviceTensor) for x in args) else "cpu"
            found = "cuda" if generator in _DEVICE_GENERATORS else "cpu"
            if wanted != found:
                raise RuntimeError(f"Expected a '{wanted}' device type for generator but found '{found}'")
        pinned = kwargs.pop("pin_memory", False)
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            return _to(func, *args, **kwargs)
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return _to(func, args[0], CUDA)
        if name == "cpu" and args and isinstance(args[0], DeviceTensor):
            return _to(func, args[0], torch.device("cpu"))
        if name == "pin_memory":
            return queue().pin(args[0].clone())
        if name == "is_pinned":
            return False
        if name in ("copy_", "__setitem__") and not any(isinstance(x, DeviceTensor) for x in args[:3]):
            queue().check_write(args[0])
        if name == "copy_" and any(isinstance(x, DeviceTensor) for x in args[:2]):
            crossing = isinstance(args[0], DeviceTensor) != isinstance(args[1], DeviceTensor)
            if crossing and not kwargs.get("non_blocking"):
                synced("blocking copy_ between the host and the device")
            elif crossing and isinstance(args[1], DeviceTensor):  # to the host
                if queue().copied_to_host(args[0], args[1].elem):
                    return args[0]  # the values land when the host waits past the copy
                synced("non-blocking copy_ into pageable host memory (CUDA returns once it landed)")
            elif crossing:
                queue().copied(args[1])
            if crossing and isinstance(args[0], DeviceTensor):
                copied_to_device(args[1])
            return aten.copy_.default(args[0], args[1])  # the binding's device guard needs CUDA
        if name in ("nonzero", "argwhere") and isinstance(args[0], DeviceTensor):  # so does theirs
            synced(f"{name} of a device tensor (its output sized by its values)")
            return DeviceTensor(func(args[0].elem, *args[1:], **kwargs))
        if name == "contiguous" and isinstance(args[0], DeviceTensor):  # its binding's guard needs CUDA
            contiguous = args[0].elem.contiguous(*args[1:], **kwargs)
            return args[0] if contiguous is args[0].elem else DeviceTensor(contiguous)
        if name == "__invert__" and isinstance(args[0], DeviceTensor):  # so does ``~``'s
            return DeviceTensor(~args[0].elem)
        if name in ("tolist", "__int__", "__float__", "__bool__", "__index__") and isinstance(args[0], DeviceTensor):
            synced(f"{name} of a device tensor")
            return getattr(args[0].elem, name)()  # read back (a synchronisation), as CUDA does
        if name in ("numpy", "__array__") and isinstance(args[0], DeviceTensor):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if name == "__getitem__" and isinstance(args[0], DeviceTensor):
            return self._getitem(*args)
        if name == "__setitem__" and isinstance(args[0], DeviceTensor):
            return self._setitem(*args)
        if _wants_device(kwargs) and name != "device":  # factories, new_*, *_like
            if name in ("tensor", "as_tensor"):
                synced(f"torch.{name}(..., device=cuda): a blocking copy of host data")
            return _wrap(func(*tree_map(host_value, args), **{**kwargs, "device": torch.device("cpu")}))
        result = func(*args, **kwargs)
        return queue().pin(result) if pinned and isinstance(result, torch.Tensor) else result

    @staticmethod
    def _getitem(tensor: DeviceTensor, index: Any) -> torch.Tensor:
        flat = [x for x in tree_flatten(index)[0] if isinstance(x, torch.Tensor)]
        check_devices(aten.index.Tensor, (tensor, flat), {})
        _host_index(index)
        return DeviceTensor(tensor.elem[tree_map(host_value, index)])

    @staticmethod
    def _setitem(tensor: DeviceTensor, index: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(part, (torch.Tensor, list)) for part in parts):  # CUDA's index_put_
                check_devices(aten.index_put_.default, (tensor, [], value), {})
            elif not isinstance(value, DeviceTensor) and value.dim() > 0:
                # basic indexing is a view and a copy_, which crosses devices (blocking)
                synced(f"a host tensor {tuple(value.shape)} set into a device tensor (a blocking copy)")
            if not isinstance(value, DeviceTensor) and value.dim() > 0:
                copied_to_device(value)
        _host_index(index)
        tensor.elem[tree_map(host_value, index)] = host_value(value)


def _host_index(index: Any) -> None:
    """CUDA copies a host index tensor (or a list) to the device with a blocking copy, and
    sizes a boolean mask's result by reading the mask back."""
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(part, list) or (isinstance(part, torch.Tensor) and not isinstance(part, DeviceTensor)
                                      and part.dim() > 0) for part in parts):
        synced("indexing a device tensor with host indices")
    elif any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts):
        synced("indexing a device tensor with a boolean mask (its output sized by the mask's values)")


def _triton_launch(kernel: Any, grid: Any, args: tuple, kwargs: dict, launch: Callable[[tuple, dict], Any]) -> Any:
    """A kernel reads device memory: device tensors give theirs, a host tensor is refused."""

    def pointer(position: Any, x: Any) -> Any:
        if isinstance(x, DeviceTensor):
            return x.elem
        if isinstance(x, torch.Tensor):
            raise ValueError(f"Pointer argument (at {position}) cannot be accessed from Triton (cpu tensor?)")
        return x

    return launch(tuple(pointer(i, a) for i, a in enumerate(args)), {k: pointer(k, v) for k, v in kwargs.items()})


@contextmanager
def fake_cuda() -> Iterator[None]:
    """Inside the block, ``cuda`` is the stand-in device."""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    # Module.to("cuda") then wraps each parameter anew, rather than setting a host
    # parameter's ``.data`` to a device tensor (a shallow copy that loses the subclass)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    reset_queue()
    try:
        with ExitStack() as stack:
            stack.enter_context(_Placement())
            stack.enter_context(intercept_launches(_triton_launch))
            yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)

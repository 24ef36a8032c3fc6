"""CustomOp: a layer with a plain PyTorch ``forward_native`` and, per platform, a faster one.

The hot elementwise layers (RMSNorm, SiLU-and-mul, rotary embeddings) are each five to
fifteen eager ops; a platform may supply one fused kernel instead. Which implementation a
layer runs is chosen once per model, after loading, by ``dispatch_custom_ops`` asking the
platform (``Platform.custom_op``), in the manner of vLLM's ``CustomOp``, for the ops
``compilation_config.custom_ops`` leaves on: under ``["none"]`` nothing is dispatched, so
``forward_native`` stays the reference the platform's kernels are tested against.

A platform's implementation is called as ``impl(layer, *args)``; where it cannot take an
input (a dtype its kernel was not built for) it returns ``layer.forward_native(*args)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from torch import nn

#: ``impl(layer, *args, **kwargs)``: a platform's implementation of one op
OpImplementation = Callable[..., Any]


class OpProvider(Protocol):
    """What dispatch asks: the platform (``tokenmill.interfaces.platform.Platform``)."""

    def custom_op(self, layer: nn.Module) -> Optional[OpImplementation]:
        """The implementation for ``layer`` (whose ``op_name`` says which op it is), or None."""


class CustomOp(nn.Module):
    """Subclasses set ``op_name`` and implement ``forward_native``."""

    #: the name platforms know the op by ("rms_norm", "silu_and_mul", "rotary_embedding"); a
    #: class covering several ops sets it per instance
    op_name: str
    #: whether ``forward_native`` can be recorded in a CUDA graph (it reads nothing back from the
    #: device); where one that cannot runs, decode steps run without graphs
    native_in_graphs: bool = True

    def __init__(self) -> None:
        super().__init__()
        #: the platform's implementation chosen by dispatch_custom_ops; None runs forward_native
        self.op_impl: Optional[OpImplementation] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.op_impl is not None:
            return self.op_impl(self, *args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def dispatch_custom_ops(model: nn.Module, provider: OpProvider, enabled: Callable[[str], bool]) -> int:
    """Give each CustomOp of ``model`` whose op is ``enabled`` the provider's implementation;
    returns how many got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.op_impl = provider.custom_op(module) if enabled(module.op_name) else None
            count += module.op_impl is not None
    return count

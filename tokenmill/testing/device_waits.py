"""Which operations make the host wait for a CUDA device: those that read a value back, and
those whose output is sized by the values (the host must learn the size before it can
allocate the result). The CUDA stand-in (``fake_cuda``) counts them as waits, and the graph
stand-in (``device_graphs``) refuses them inside a recording, as stream capture does."""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

#: a value read back, or an output sized by values; repeat_interleave only without its output_size
ATEN_SYNCS = frozenset({aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                        aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                        aten.bincount.default, aten.equal.default, aten.is_nonzero.default,
                        aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
#: indexing: a boolean mask among the indices sizes the output by its values
INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                      aten._index_put_impl_.default, aten._unsafe_index.Tensor})


def waits(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether CUDA's ``func`` waits for the device: ``ATEN_SYNCS``, or indexing by a boolean mask."""
    if func in ATEN_SYNCS:
        return not (func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
                    and kwargs.get("output_size") is not None)
    return func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                    for i in args[1] if i is not None)

"""Prepacked GEMM weights: the cpu platform's linear method for unquantized layers."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import nn

from tokenmill.core.layers.linear import Linear, UnquantizedLinearMethod
from tokenmill.interfaces.models import OutputProjection
from tokenmill.plugins.platforms.cpu.onednn_layout import packed_view


class PrepackedLinearMethod:
    """Plain weights reordered once, after loading, into a GEMM kernel's blocked layout.

    ``F.linear`` hands MKL/oneDNN a row-major weight that the library re-blocks
    on every call; a prepacked weight skips that. Measured here (1 thread, the
    Llama shapes of benchmarks/, batch 1 to 2048): fp32 1.2x to 2.3x and bf16
    1.05x to 3x faster than ``F.linear``, the largest gains at decode batch
    sizes. oneDNN's packed tensor is opaque (``torch._mkldnn`` layout).

    With ``panels`` (the C++ kernels module, on CPUs where ``packed_gemm_preferred``:
    AVX2 without AVX-512), fp32 GEMMs run tokenmill's own register-tiled kernel on
    weights packed in column panels instead (``csrc/packed_gemm.cpp``: 1.05-1.25x
    oneDNN's there at the benchmark shapes). A weight whose values are all bf16 (a bf16
    checkpoint computed in fp32) is packed in bf16 panels, which the kernel widens exactly:
    half the bytes, the same results.

    With ``gemv`` (the C++ kernels module), inputs of 1 or 2 rows (``gemv_max_rows``: up to 5
    where it reads AVX2 panels) go to the streaming GEMV kernel, which reads weights at the
    memory's bandwidth where oneDNN reaches about two thirds of it (batch-1 decode is bound by
    that read). On AVX-512 cores the GEMV of an
    fp32 layer, and on AVX512-BF16 cores of a bf16 one, reads oneDNN's packed copy in place
    (``blocked``: onednn_layout.py); on AVX2 cores it reads the panels above, of either
    dtype. The layer then holds one copy of its weights. Elsewhere (a bf16 weight computed in
    fp32 by oneDNN: the GEMV streams it in bf16, half the packed copy's bytes) the plain weight
    is kept beside the packed one for the GEMV, a second copy; ``small_batch_gemv: false``
    keeps only the packed one.
    """

    #: inputs with at most this many rows use the GEMV kernel (measured crossover: 3 rows)
    GEMV_MAX_ROWS = 2
    #: the same where the GEMV reads the AVX2 panels in place (pairs of blocks, four streams):
    #: 1.1-1.7x the packed GEMM at 3-5 rows, level at 6 for bf16 panels (benchmarks/README.md)
    PANEL_GEMV_MAX_ROWS = 5

    def __init__(self, gemv: Optional[ModuleType] = None, widen: bool = False,
                 panels: Optional[ModuleType] = None, out_features: int = 0) -> None:
        self.gemv = gemv
        #: bf16 activations on a CPU without bf16 arithmetic: the packed weight is
        #: fp32, each call widens its input and rounds its output once (~7x PyTorch's bf16 GEMM there)
        self.widen = widen
        self.panels = panels
        self.out_features = out_features
        #: oneDNN's packed weight read in place (bf16 [N / NB, K / 2, NB, 2], fp32
        #: [N / NB, K, NB]), where the layer keeps no plain weight
        self.blocked: Optional[torch.Tensor] = None

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        raise TypeError("PrepackedLinearMethod is applied to loaded layers by prepack_linear_weights")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of a plain ``weight`` [out, in]."""
        if self.panels is not None:
            return self.panels.pack_gemm_weight(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight.float() if self.widen else weight)

    @property
    def gemv_max_rows(self) -> int:
        """Rows of x up to which this layer's inputs take the GEMV."""
        return self.PANEL_GEMV_MAX_ROWS if self.panels is not None and self.blocked is not None else self.GEMV_MAX_ROWS

    def gemv_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight the GEMV reads: oneDNN's packed copy in place, or the plain one."""
        return self.blocked if self.blocked is not None else layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.gemv is not None and 0 < x.numel() <= self.gemv_max_rows * x.shape[-1]:
            return self.gemv.gemv(x.contiguous(), self.gemv_weight(layer), bias)
        if self.widen:
            bias = None if bias is None else bias.float()
        wide = x.float() if self.widen else x
        if self.panels is not None:
            y = self.panels.packed_gemm(wide.contiguous(), layer.packed_weight, self.out_features, bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(wide, layer.packed_weight, bias, "none", [], "")
        return y.to(x.dtype) if self.widen else y


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


def prepack_linear_weights(model: nn.Module, kernels: Optional[ModuleType] = None, gemv: bool = True,
                           widen_bf16: bool = False) -> int:
    """Give every unquantized CPU ``Linear`` of ``model`` a prepacked weight; returns how many.

    ``kernels``: the C++ kernels module (None: oneDNN's packing only). With it, fp32 GEMMs
    use its packed GEMM where it is preferred on this CPU, and with ``gemv`` plain weights
    are kept for 1-2 row inputs (see PrepackedLinearMethod). ``widen_bf16`` (a CPU without
    bf16 arithmetic) packs bf16 weights as fp32 GEMMs. A weight whose packed copy the GEMV can
    read (unpadded panels, or ``kernels.onednn_gemv_dtypes()``: a layout onednn_layout.py knows)
    drops its plain copy, unless another module shares it (a tied embedding looks rows up in
    it) or it is the model's fp32 output projection of other than bf16 values (the greedy head
    recomputes candidate rows from it in fp32). An fp32 weight whose values are all bf16 (a
    bf16 checkpoint computed in fp32) is kept in bf16, panels and plain copy alike: the kernels
    stream half the bytes and widen them exactly, so their results are unchanged. Quantized
    layers keep their own kernels; other dtypes (fp16) stay on ``F.linear``.
    """
    count = 0
    gemv_kernels = kernels if gemv else None
    panels = kernels if kernels is not None and kernels.packed_gemm_preferred() else None
    keep = getattr(model, "keeps_plain_weights", False)  # updates write into the plain weights
    in_place = set(gemv_kernels.onednn_gemv_dtypes()) if gemv_kernels is not None else set()
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m._parameters.values()}
    projection = model.output_projection() if isinstance(model, OutputProjection) else None
    # the greedy head recomputes candidate rows from an fp32 projection (not from one kept in bf16)
    greedy_rows = id(projection) if projection is not None and projection.dtype == torch.float32 else None
    for module in model.modules():
        if not isinstance(module, Linear) or type(module.method) is not UnquantizedLinearMethod:
            continue
        if not _can_prepack(module.weight):
            continue
        weight = module.weight.detach()
        widen = weight.dtype == torch.bfloat16 and widen_bf16
        fp32_gemm = panels if widen or weight.dtype == torch.float32 else None
        method = PrepackedLinearMethod(gemv_kernels, widen, fp32_gemm, weight.shape[0])
        narrow = (weight.to(torch.bfloat16) if weight.dtype == torch.float32
                  and (gemv_kernels is not None or fp32_gemm is not None) else None)
        bf16_exact = narrow is not None and torch.equal(narrow.float(), weight)  # kept in bf16 instead
        packed_source = narrow if bf16_exact and fp32_gemm is not None else weight
        module.register_buffer("packed_weight", method.pack(packed_source), persistent=False)
        # the GEMV reads the panels of either dtype; oneDNN's layouts where onednn_gemv_dtypes says so
        readable = fp32_gemm is not None or (str(weight.dtype) in in_place and not (widen or bf16_exact))
        plain_read = id(module.weight) in shared or (id(module.weight) == greedy_rows and not bf16_exact)
        if gemv_kernels is not None and readable and not (keep or plain_read):
            method.blocked = (_panels_view(module.packed_weight, weight) if fp32_gemm is not None
                              else packed_view(module.packed_weight, weight))
        if keep:
            pass
        elif gemv_kernels is None or method.blocked is not None:
            del module.weight
        elif bf16_exact:
            # a new Parameter, not .data: a tied embedding keeps its own dtype
            module.weight = nn.Parameter(narrow, requires_grad=False)
        module.method = method
        count += 1
    return count


def _panels_view(panels: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed GEMM's panels ``[N / 16, K, 16]`` (fp32 or bf16) as the GEMV's blocks, where
    no panel is padded (the GEMV writes every row of every block)."""
    return panels if panels.shape[0] * panels.shape[2] == weight.shape[0] else None


def repack_linear_weights(model: nn.Module) -> None:
    """Pack each prepacked layer's (updated) plain weight again; a released (empty) weight
    releases its packed copy."""
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, PrepackedLinearMethod):
            weight = module.weight.detach()
            module.packed_weight = module.method.pack(weight) if weight.numel() else torch.empty(0)

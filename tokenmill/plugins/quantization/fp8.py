"""FP8 (e4m3) weights: vLLM's ``fp8`` checkpoints, ``compressed-tensors`` float-quantized
checkpoints, and online quantization of unquantized checkpoints.

Three kernels (``quantization.fp8_kernel``). ``scaled_mm`` (the default for per-tensor and
per-channel W8A8 checkpoints of 16-bit models where the weights live on a GPU) keeps the e4m3 weights and
multiplies FP8 activations by them with ``torch._scaled_mm``, scaled per token (dynamic) or
per tensor (static) on the activation side and per output channel on the weight side (a
per-tensor scale of each fused part, expanded); the log's weight memory shows the saving.
``triton`` (the default for 128x128 block checkpoints on a GPU) keeps their e4m3 weights and
block scales and multiplies with the Triton GEMM in ``triton_block_fp8``, which widens each
weight tile in registers, after the same per-token rounding of activations; on a CPU it
runs in Triton's interpreter (``TRITON_INTERPRET=1``, for tests). ``dequantize`` (the
default on CPUs, which have no FP8 arithmetic) widens the weights once, at load, to the
compute dtype and applies the same quantize-dequantize to activations. All compute the same
W8A8 product. Weight-only per-tensor and per-channel schemes
(``quantization.quantize_activations`` off, online FP8) always dequantize; ``scaled_mm``
leaves block checkpoints to ``dequantize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tokenmill.core.layers.linear import shard_loader
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins import triton_env
from tokenmill.plugins.quantization.group_quant import ignored, output_shard_loader

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round ``x`` through FP8 with ``scale`` (quantize, then dequantize)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scale


@dataclass(frozen=True)
class Fp8Scheme:
    weights: str  # "tensor" | "channel" | "block"
    block: Optional[tuple[int, int]] = None
    activations: Optional[str] = None  # None | "static" (per tensor) | "token" (dynamic)
    scale_name: str = "weight_scale"


class Fp8LinearMethod:
    def __init__(self, scheme: Fp8Scheme, quantize_activations: bool, online: bool = False,
                 kernel: str = "auto") -> None:
        self.scheme = scheme
        self.kernel = kernel
        #: splits over tensor-parallel ranks by output rows or input columns, its scales per
        #: tensor or per output channel following; 128x128 blocks would straddle the slices
        self.tensor_parallel = online or scheme.weights != "block"
        self.activations = scheme.activations if quantize_activations and not online else None
        self.online = online
        #: what the block-FP8 Triton GEMM serves: K blocks its slab divides, activations
        #: rounded per token (the fused parts' static scales would need a GEMM per part) or not
        self.triton_block = (not online and scheme.weights == "block" and scheme.block[1] % 16 == 0
                             and self.activations != "static")
        if kernel == "triton" and not self.triton_block:
            raise ConfigError("quantization.fp8_kernel",
                              "triton multiplies block-wise FP8 checkpoints (weight blocks a multiple of 16 wide in K, "
                              "dynamic or no activation quantization); use auto, scaled_mm or dequantize for this one")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        n, shards = sum(output_sizes), len(output_sizes)
        offsets = [sum(output_sizes[:i]) for i in range(shards)]
        layer.quant_dtype, layer.quant_output_sizes = dtype, output_sizes

        def add(name: str, tensor: torch.Tensor, loader, output_dim=None, input_dim=None) -> None:
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = loader  # type: ignore[attr-defined]
            param.output_dim, param.input_dim = output_dim, input_dim  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

        if self.online:
            add("weight", torch.empty(n, input_size, dtype=dtype), shard_loader(output_sizes), 0, 1)
            return
        add("weight", torch.empty(n, input_size, dtype=FP8), shard_loader(output_sizes), 0, 1)
        scheme = self.scheme
        if scheme.weights == "tensor":
            add(scheme.scale_name, torch.ones(shards, dtype=torch.float32), _scalar_per_shard(shards))
        elif scheme.weights == "channel":
            add(scheme.scale_name, torch.ones(n, 1, dtype=torch.float32), output_shard_loader(offsets, output_sizes, 0),
                0)
        else:
            bn, bk = scheme.block
            rows = [-(-size // bn) for size in output_sizes]
            layer.quant_block_sizes = output_sizes
            add(scheme.scale_name, torch.ones(sum(rows), -(-input_size // bk), dtype=torch.float32),
                _block_scale_loader(layer, output_sizes, bn))
        if scheme.activations == "static":
            add("input_scale", torch.ones(shards, dtype=torch.float32), _scalar_per_shard(shards))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if self._triton(w):  # e4m3 weights and block scales stay; each output row's scale row
            if w.device.type != "cuda" and not triton_env.INTERPRETED:
                raise ConfigError("quantization.fp8_kernel",
                                  "triton runs on a CUDA GPU, or on a CPU in Triton's interpreter (TRITON_INTERPRET=1)")
            layer.register_buffer("fp8_scale_rows", block_scale_rows(layer.quant_block_sizes, self.scheme.block[0])
                                  .to(device=w.device, dtype=torch.int32), persistent=False)
            layer.fp8_triton = True
            return
        if self._scaled_mm(layer, w):  # e4m3 weights stay; the scales become one per output channel
            layer.register_buffer("fp8_weight_scale", self._expanded_scale(layer, w.shape).reshape(1, -1).float(),
                                  persistent=False)
            delattr(layer, self.scheme.scale_name)
            layer.fp8_scaled_mm = True
            return
        if self.online:  # per-channel FP8 of a full-precision checkpoint
            scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            dequant = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        else:
            dequant = w.float() * self._expanded_scale(layer, w.shape)
            delattr(layer, self.scheme.scale_name)
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(dequant.to(layer.quant_dtype), requires_grad=False))

    def _scaled_mm(self, layer: nn.Module, weight: torch.Tensor) -> bool:
        """Whether this layer multiplies in FP8: a W8A8 scheme with per-tensor or per-channel
        weight scales, sizes CUDA's ``torch._scaled_mm`` takes, and the kernel asked for (or
        "auto" on a GPU for a 16-bit model).

        An fp32 model, chosen for precision, dequantizes under "auto": Hopper's FP8 tensor
        cores accumulate with fewer bits than fp32, and the next layer's FP8 rounding
        magnifies the difference (an H100's fp32 logits: 1.5-1.7e-2 off the exact W8A8
        product, which the dequantizing path meets to 1e-7)."""
        if self.online or self.activations is None or self.scheme.weights == "block":
            return False
        auto = self.kernel == "auto" and weight.device.type == "cuda" and layer.quant_dtype != torch.float32
        if not (self.kernel == "scaled_mm" or auto):
            return False
        # CUDA's kernel takes K and each multiplied part's N in multiples of 16 (the CPU's any)
        parts = layer.quant_output_sizes if self.activations == "static" else [weight.shape[0]]
        if weight.shape[1] % 16 == 0 and all(n % 16 == 0 for n in parts):
            return True
        if self.kernel == "scaled_mm":
            raise ConfigError("quantization.fp8_kernel",
                              f"torch._scaled_mm multiplies sizes in multiples of 16 on a GPU; a layer here is "
                              f"{weight.shape[1]} wide into {list(parts)}: use fp8_kernel auto or dequantize")
        return False

    def _triton(self, weight: torch.Tensor) -> bool:
        """Whether this layer multiplies with the block-FP8 Triton GEMM: a block scheme it
        serves, and the kernel asked for (or "auto" on a GPU)."""
        on_gpu = weight.device.type == "cuda"
        return self.triton_block and (self.kernel == "triton" or (self.kernel == "auto" and on_gpu))

    def _expanded_scale(self, layer: nn.Module, shape: torch.Size) -> torch.Tensor:
        scale = getattr(layer, self.scheme.scale_name).data
        if self.scheme.weights == "channel":
            return scale
        if self.scheme.weights == "tensor":
            repeats = torch.tensor(layer.quant_output_sizes, device=scale.device)
            return torch.repeat_interleave(scale, repeats).unsqueeze(1)
        bn, bk = self.scheme.block
        rows = block_scale_rows(layer.quant_block_sizes, bn).to(scale.device)
        return scale[rows].repeat_interleave(bk, 1)[:, : shape[1]]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if getattr(layer, "fp8_scaled_mm", False):
            return self._apply_scaled_mm(layer, x, bias)
        if getattr(layer, "fp8_triton", False):
            return self._apply_triton(layer, x, bias)
        if self.activations is None:
            return nn.functional.linear(x, layer.weight, bias)
        if self.activations == "static":
            # each fused part has its own input scale (they were separate modules)
            outs, start = [], 0
            for i, size in enumerate(layer.quant_output_sizes):
                xq = fake_quantize(x, layer.input_scale[i])
                outs.append(nn.functional.linear(xq, layer.weight[start:start + size]))
                start += size
            out = torch.cat(outs, dim=-1)
            return out if bias is None else out + bias
        return nn.functional.linear(fake_quantize(x, _token_scale(layer, x).to(x.dtype)), layer.weight, bias)

    def _apply_scaled_mm(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """FP8 x FP8 with row-wise scales: per token (or the static scale, repeated) for the
        activations, per output channel for the weights; fp32 accumulation. The tokens are
        padded to a multiple of 16, as K and N are (``_scaled_mm``): on an H200, cuBLASLt
        refused a one-token step's product (CUBLAS_STATUS_NOT_SUPPORTED, m 64 n 1 k 128)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        if tokens % 16:
            x = torch.cat([x, x.new_zeros(16 - tokens % 16, x.shape[1])])
        if self.activations == "static":  # each fused part has its own input scale
            outs, start = [], 0
            for i, size in enumerate(layer.quant_output_sizes):
                scale = layer.input_scale[i].float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
                outs.append(_scaled_mm(_to_fp8(x, scale), layer.weight[start:start + size].t(), scale,
                                       layer.fp8_weight_scale[:, start:start + size].contiguous(), x.dtype))
                start += size
            out = torch.cat(outs, dim=-1)
        else:
            scale = _token_scale(layer, x)
            out = _scaled_mm(_to_fp8(x, scale), layer.weight.t(), scale, layer.fp8_weight_scale, x.dtype)
        out = out[:tokens]
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

    def _apply_triton(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The block-FP8 Triton GEMM on the e4m3 weights, after the dequantizing path's
        per-token rounding of activations through FP8."""
        from tokenmill.plugins.quantization.triton_block_fp8 import block_fp8_gemm

        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.activations is not None:
            x = fake_quantize(x, _token_scale(layer, x).to(x.dtype))
        out = block_fp8_gemm(x, layer.weight, getattr(layer, self.scheme.scale_name), layer.fp8_scale_rows,
                             self.scheme.block[1])
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])


def block_scale_rows(part_sizes: list[int], block_n: int) -> torch.Tensor:
    """Each output row's row of block scales (int64 [N]). A fused layer's parts stack their own
    block rows, so a part's row ``j`` takes the part's block row ``j // block_n``: past a part
    whose size is not a multiple of ``block_n``, not the fused row's ``n // block_n``."""
    rows, first = [], 0
    for size in part_sizes:
        rows.append(first + torch.arange(size) // block_n)
        first += -(-size // block_n)
    return torch.cat(rows)


def _token_scale(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scales [tokens, 1], float32: the row's absolute maximum
    over FP8's range (under tensor parallelism, the whole row's, by a max all-reduce)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    shard = getattr(layer, "shard", None)
    if shard is not None and shard.reduces:  # each rank holds a slice of the row: its scale is the whole row's
        amax = shard.parallel.comm.all_reduce(amax, "max")
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of FP8 operands, scaled by rows of ``scale_a`` [M, 1] and columns of
    ``scale_b`` [1, N], in ``dtype``. cuBLASLt's row-wise scaling writes bf16 only, which
    would round an fp32 model's every product to bf16 (2e-2 relative in its logits); fp32
    models multiply with unit scales into fp32 and scale after."""
    if dtype != torch.float32:
        out_dtype = torch.bfloat16 if a.device.type == "cuda" else dtype
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype).to(dtype)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32) * scale_a * scale_b


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _block_scale_loader(layer: nn.Module, output_sizes: list[int], block_n: int):
    """Block scales of a fused layer: per-part tensors stack their block rows, each part's
    last block partial where its size is not a multiple of ``block_n``. A checkpoint that
    fused the layer on disk (Phi-3's qkv_proj) has one scale whose blocks run over the
    fused rows instead, so they straddle the parts; ``layer.quant_block_sizes`` records
    which blocking was loaded, for the expansion."""
    rows = [-(-size // block_n) for size in output_sizes]
    per_part = output_shard_loader([sum(rows[:i]) for i in range(len(rows))], rows, 0)
    fused_rows = -(-sum(output_sizes) // block_n)  # never more than sum(rows)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        if shard_id is not None:
            per_part(param, loaded, shard_id)
            return
        target = param.data[:fused_rows]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)}, checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)
        layer.quant_block_sizes = [sum(output_sizes)]

    return load


def _scalar_per_shard(shards: int):
    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        value = loaded.reshape(())
        if shard_id is None:
            param.data.fill_(value)
        else:
            param.data[shard_id] = value

    return load


class Fp8Method:
    """vLLM's ``quant_method: fp8`` (per-tensor or 128x128 block), or online FP8 when the
    checkpoint is unquantized."""

    name = "fp8"

    def __init__(self, config: dict[str, Any], options: Any = None) -> None:
        quantize_activations = getattr(options, "quantize_activations", True)
        kernel = getattr(options, "fp8_kernel", "auto")
        if not config:  # online: quantization="fp8" over a full-precision checkpoint
            self.method = Fp8LinearMethod(Fp8Scheme("channel"), quantize_activations, online=True, kernel=kernel)
            self.ignored_layers = None
            return
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ConfigError("quantization_config.activation_scheme", f"unknown activation scheme {scheme!r}")
        block = config.get("weight_block_size")
        if block is not None:
            if scheme != "dynamic":
                raise ConfigError("quantization_config.activation_scheme", "block-wise FP8 needs dynamic activations")
            # activations: dynamic per token, as the reference dequantizer of the shared
            # checkpoints prescribes (DeepSeek-style kernels use 1x128 token groups)
            fp8 = Fp8Scheme("block", tuple(block), "token", "weight_scale_inv")
        else:
            fp8 = Fp8Scheme("tensor", None, "static" if scheme == "static" else "token")
        self.method = Fp8LinearMethod(fp8, quantize_activations, kernel=kernel)
        self.ignored_layers = config.get("ignored_layers")

    def linear_method(self, prefix: str) -> Optional[Fp8LinearMethod]:
        return None if ignored(prefix, self.ignored_layers) else self.method


class CompressedTensorsMethod:
    """``compressed-tensors`` checkpoints in the float-quantized (FP8) format."""

    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any], options: Any = None) -> None:
        fmt = config.get("format")
        if fmt != "float-quantized":
            raise ConfigError("quantization_config.format", f"compressed-tensors format {fmt!r} is not supported "
                                                            "(float-quantized)")
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ConfigError("quantization_config.config_groups", "exactly one config group is supported")
        weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError("quantization_config.config_groups.weights", "only 8-bit float weights are supported")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ConfigError("quantization_config.config_groups.weights.strategy", f"unsupported strategy {strategy!r}")
        block = tuple(weights["block_structure"]) if strategy == "block" else None
        activations = None
        if inputs:
            if inputs.get("dynamic") and inputs.get("strategy") == "token":
                activations = "token"
            elif not inputs.get("dynamic") and inputs.get("strategy") == "tensor":
                activations = "static"
            else:
                raise ConfigError("quantization_config.config_groups.input_activations",
                                  f"unsupported activation scheme {inputs}")
        scheme = Fp8Scheme(strategy, block, activations)
        self.method = Fp8LinearMethod(scheme, getattr(options, "quantize_activations", True),
                                      kernel=getattr(options, "fp8_kernel", "auto"))
        self.ignore = config.get("ignore")

    def linear_method(self, prefix: str) -> Optional[Fp8LinearMethod]:
        return None if ignored(prefix, self.ignore) else self.method


@hookimpl
def register_quantization_methods(register):
    register("fp8", Fp8Method)
    register("compressed-tensors", CompressedTensorsMethod)

"""On a CUDA GPU: FP8 checkpoints on the device. Per-tensor and per-channel W8A8 checkpoints of
16-bit models keep their e4m3 weights and multiply with torch._scaled_mm; an fp32 model
dequantizes (Hopper's FP8 tensor cores accumulate with fewer bits than fp32, and the next
layer's FP8 rounding magnifies that: 1.5-1.7e-2 off the W8A8 logits on an H100) and meets the
shared W8A8 reference logits to fp32 summation order. 128x128 blocks keep e4m3 weights in any
dtype and multiply with the block-FP8 Triton GEMM."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUANT_CHECKPOINTS
from cuda_engines import GPU_SHARE
from tokenmill import LLM, load_config
from tokenmill.plugins.quantization.fp8 import FP8_MAX
from tokenmill.testing.logits import prompt_logits

CHECKPOINTS = QUANT_CHECKPOINTS
PER_TENSOR_AND_CHANNEL = ["ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "fp8-tensor-static"]


def w8a8_product(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The exact product of the FP8 operands the layer's scaled_mm path forms, in fp64:
    activations rounded through FP8 (per token, or per fused part's static scale), weights
    e4m3 times their per-output-channel scales."""
    weight = layer.weight.double() * layer.fp8_weight_scale.double().reshape(-1, 1)

    def rounded(scale: torch.Tensor) -> torch.Tensor:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * scale.double()

    if layer.method.activations == "static":
        parts, start = [], 0
        for i, size in enumerate(layer.quant_output_sizes):
            parts.append(rounded(layer.input_scale[i].float()) @ weight[start:start + size].T)
            start += size
        return torch.cat(parts, dim=-1)
    return rounded((x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)) @ weight.T


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", PER_TENSOR_AND_CHANNEL)
def test_fp32_fp8_models_dequantize_and_match_the_w8a8_reference(name):
    reference = load_file(CHECKPOINTS / name / "reference.safetensors")
    config = load_config(model=str(CHECKPOINTS / name), device="cuda", dtype="float32",
                         gpu_memory_utilization=GPU_SHARE)
    engine = LLM(config=config).llm_engine
    layer = engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float32 and layer.weight.device.type == "cuda"
    logits = torch.stack([prompt_logits(engine, row.tolist()).cpu() for row in reference["input_ids"]])
    expected = reference["logits_w8a8"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-3


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", PER_TENSOR_AND_CHANNEL)
def test_bf16_fp8_models_multiply_e4m3_weights_with_scaled_mm(name):
    """Each layer's product against the exact product of the same FP8 operands. The bound,
    1e-2, is bf16's output rounding (2^-9 relative) plus the FP8 tensor cores' accumulation;
    a lost scale or a transposed weight is off by far more. (Whole-model logits cannot tell:
    a bf16 model's own rounding puts them 3.5e-2 off the fp32 W8A8 reference, about as far as
    from the unquantized-activation logits.)"""
    config = load_config(model=str(CHECKPOINTS / name), device="cuda", dtype="bfloat16",
                         gpu_memory_utilization=GPU_SHARE)
    model = LLM(config=config).llm_engine.runner.model
    generator = torch.Generator(device="cuda").manual_seed(0)
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.down_proj):
        assert layer.weight.dtype == torch.float8_e4m3fn and getattr(layer, "fp8_scaled_mm", False)
        x = torch.randn(33, layer.weight.shape[1], device="cuda", generator=generator).to(torch.bfloat16)
        got = layer.method.apply(layer, x, None).double()
        expected = w8a8_product(layer, x)
        assert torch.isfinite(got).all()
        assert ((got - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
def test_block_fp8_on_the_gpu_keeps_e4m3_weights_and_matches_the_w8a8_reference():
    """128x128 blocks take the Triton GEMM by default on a GPU: e4m3 weights and block scales
    stay on the device. Its fp32 sums run in another order than the reference's, which flips
    a few activations' FP8 rounding in the next layer: 2e-3 relative on CPU's interpreter,
    against 4e-2 between the W8A8 and unquantized-activation logits, so the bound is 1e-2."""
    path = CHECKPOINTS / "fp8-block"
    reference = load_file(path / "reference.safetensors")
    config = load_config(model=str(path), device="cuda", dtype="float32",
                         gpu_memory_utilization=GPU_SHARE)
    engine = LLM(config=config).llm_engine
    layer = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.device.type == "cuda"
    assert layer.fp8_scale_rows.device.type == "cuda" and layer.weight_scale_inv.dtype == torch.float32
    logits = torch.stack([prompt_logits(engine, row.tolist()).cpu() for row in reference["input_ids"]])
    expected = reference["logits_w8a8"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-2

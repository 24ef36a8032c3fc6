"""On a CUDA GPU: FP8 checkpoints keep their e4m3 weights on the device and multiply with
torch._scaled_mm (per-tensor and per-channel scales) or the block-FP8 Triton GEMM (128x128
blocks), reproducing the shared W8A8 reference logits. cuBLASLt writes row-wise scaled
products in bf16, so fp32 models multiply with unit scales into fp32 and scale after; the
bound stays 1e-2, for Hopper's FP8 tensor cores, which accumulate with fewer bits than fp32
between their periodic promotions."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from conftest import QUANT_CHECKPOINTS
from cuda_engines import GPU_SHARE
from tokenmill import LLM, load_config
from tokenmill.testing.logits import prompt_logits

CHECKPOINTS = QUANT_CHECKPOINTS


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", ["ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "fp8-tensor-static"])
def test_fp8_on_the_gpu_matches_the_w8a8_reference(name):
    reference = load_file(CHECKPOINTS / name / "reference.safetensors")
    config = load_config(model=str(CHECKPOINTS / name), device="cuda", dtype="float32",
                         gpu_memory_utilization=GPU_SHARE)
    engine = LLM(config=config).llm_engine
    layer = engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.device.type == "cuda"
    logits = torch.stack([prompt_logits(engine, row.tolist()).cpu() for row in reference["input_ids"]])
    expected = reference["logits_w8a8"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-2


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

"""The block-FP8 Triton GEMM (``quantization.fp8_kernel: triton``), run by Triton's interpreter:
it equals the weights dequantized in torch, block by block, for partial blocks, fused
layers whose parts each start a block row, and every tile the GPU takes; an engine on it
reproduces the dequantizing path on a block checkpoint with its e4m3 weights kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUANT_CHECKPOINTS
from tokenmill import LLM, SamplingParams, load_config
from tokenmill.interfaces.errors import ConfigError
from tokenmill.plugins.quantization.fp8 import block_scale_rows
from tokenmill.plugins.quantization.triton_block_fp8 import block_fp8_gemm, gpu_tiles
from tokenmill.testing.logits import prompt_logits

CHECKPOINTS = QUANT_CHECKPOINTS
needs_checkpoints = pytest.mark.skipif(not CHECKPOINTS.is_dir(),
                                       reason=f"shared checkpoints not found at {CHECKPOINTS}")
BLOCK = 128


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def block_quantized(parts: list[int], k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused layer as a checkpoint stores it: each part's e4m3 weights with its own 128x128
    block scales, stacked. Returns (fp8 [N, K], scales [rows, ceil(K/128)], dequantized fp32)."""
    g = torch.Generator().manual_seed(seed)
    weights, scales, dequantized = [], [], []
    for size in parts:
        rows, cols = -(-size // BLOCK), -(-k // BLOCK)
        scale = torch.rand(rows, cols, generator=g) * 0.02 + 0.001
        expanded = scale.repeat_interleave(BLOCK, 0)[:size].repeat_interleave(BLOCK, 1)[:, :k]
        fp8 = (torch.randn(size, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        weights.append(fp8), scales.append(scale), dequantized.append(fp8.float() * expanded)
    return torch.cat(weights), torch.cat(scales), torch.cat(dequantized)


def test_every_finite_e4m3_byte_widens_exactly():
    """The kernel reads weights as bytes and widens them by bit arithmetic (sm_80 has no
    fp8e4nv): each of the 254 finite codes, subnormals and signed zeros included, equals
    torch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    weight = torch.zeros(len(finite), 16, dtype=torch.float8_e4m3fn)
    weight[:, 0] = finite
    a = torch.zeros(1, 16)
    a[0, 0] = 1.0
    got = block_fp8_gemm(a, weight, torch.ones(-(-len(finite) // BLOCK), 1), block_scale_rows([len(finite)], BLOCK)
                         .to(torch.int32), BLOCK)
    assert torch.equal(got[0], finite.float())


@pytest.mark.parametrize("m,parts,k", [
    (1, [128], 128),  # decode: one token, whole blocks
    (5, [200], 300),  # partial blocks in N and K
    (33, [100, 60, 60], 192),  # a fused qkv whose parts are not multiples of 128: 3 block rows
    (17, [200, 72, 72], 260),  # a part over two block rows, then two partial ones
], ids=["decode", "partial", "fused", "fused-2-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tiles", ["interpreter", "gpu"])
def test_kernel_equals_the_dequantized_weights(m, parts, k, dtype, tiles):
    """``x @ (fp8 * scale)^T`` with each part's rows on its own block rows of scales: fp32 to
    fp32 rounding, bf16 to bf16's; in the interpreter's tiles and in the GPU's."""
    weight, scale, dequantized = block_quantized(parts, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    tile = gpu_tiles(dtype, m, BLOCK) if tiles == "gpu" else None
    got = block_fp8_gemm(x, weight, scale, block_scale_rows(parts, BLOCK).to(torch.int32), BLOCK, tile=tile)
    assert got.dtype == dtype and got.shape == (m, sum(parts))
    expected = x.float() @ dequantized.T
    assert relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    if len(parts) > 1:  # the case tells the parts' block rows from the fused rows' n // 128
        assert not torch.equal(block_scale_rows(parts, BLOCK), torch.arange(sum(parts)) // BLOCK)


def engine(path: Path, kernel: str, quantize_activations: bool = True):
    config = load_config(model=str(path), dtype="float32", kv_cache_memory_bytes=2**24)
    config.quantization.fp8_kernel = kernel
    config.quantization.quantize_activations = quantize_activations
    return LLM(config=config)


@needs_checkpoints
@pytest.mark.parametrize("quantize_activations", [False, True], ids=["weight-only", "w8a8"])
def test_block_checkpoint_on_the_triton_kernel_matches_the_dequantizing_path(quantize_activations):
    """fp8-block with the Triton kernel forced on CPU keeps e4m3 weights and block scales and
    reproduces the dequantizing path: to fp32 rounding with weights only; with FP8 activations
    within the rounding flips that differently ordered fp32 sums cause near FP8's rounding
    boundaries (2e-3 relative, against 4e-2 between the W8A8 and unquantized-activation
    logits), and with the same greedy tokens."""
    path = CHECKPOINTS / "fp8-block"
    reference = load_file(path / "reference.safetensors")
    prompts = [row.tolist() for row in reference["input_ids"]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    logits, tokens = {}, {}
    for kernel in ("triton", "dequantize"):
        llm = engine(path, kernel, quantize_activations)
        logits[kernel] = torch.stack([prompt_logits(llm.llm_engine, p) for p in prompts])
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[kernel] = [o.outputs[0].token_ids for o in outputs]
        layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == (torch.float8_e4m3fn if kernel == "triton" else torch.float32)
    assert tokens["triton"] == tokens["dequantize"]
    expected = reference["logits_w8a8" if quantize_activations else "logits_ref"]
    bound = 1e-2 if quantize_activations else 1e-5
    assert relative_error(logits["triton"], logits["dequantize"]) < bound
    assert relative_error(logits["triton"], expected) < bound


@pytest.mark.parametrize("arch,sizes", [
    ("llama", dict(hidden_size=192, intermediate_size=320)),  # per-part partial blocks: 192, 96, 320 rows
    ("phi3", dict(hidden_size=128, intermediate_size=100, num_key_value_heads=4)),  # fused on disk, straddling
], ids=["llama-192-320", "phi3-128-100"])
def test_partial_and_straddling_blocks_on_the_triton_kernel(arch, sizes, tmp_path):
    """The loader's two blockings of a fused layer (per-part block rows, or one fused tensor
    whose blocks straddle the parts) reach the kernel as scale rows: weight-only logits
    equal a dense model holding the dequantized weights."""
    from tokenmill.testing.quantize import quantize_model
    from tokenmill.testing.tiny_models import make_tiny_model

    base = make_tiny_model(arch, tmp_path / "base", **sizes)
    quantized = quantize_model(base, tmp_path / "q", "fp8", weight_block_size=(BLOCK, BLOCK),
                               dense_copy=tmp_path / "dense")
    prompt = list(range(6, 40))
    got = prompt_logits(engine(quantized, "triton", quantize_activations=False).llm_engine, prompt)
    dense = load_config(model=str(tmp_path / "dense"), dtype="float32", kv_cache_memory_bytes=2**24)
    expected = prompt_logits(LLM(config=dense).llm_engine, prompt)
    assert relative_error(got, expected) < 1e-5


@needs_checkpoints
def test_the_triton_kernel_refuses_schemes_without_blocks_and_cpus_without_the_interpreter(monkeypatch):
    with pytest.raises(ConfigError, match="quantization.fp8_kernel: triton multiplies block-wise FP8"):
        engine(CHECKPOINTS / "fp8-tensor-static", "triton")
    monkeypatch.setattr("tokenmill.plugins.triton_env.INTERPRETED", False)
    with pytest.raises(ConfigError, match="quantization.fp8_kernel: triton runs on a CUDA GPU, or on a CPU in Triton"):
        engine(CHECKPOINTS / "fp8-block", "triton")

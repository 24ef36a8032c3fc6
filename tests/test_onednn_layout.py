"""One copy of a layer's weights: the GEMV reads the packed copy in place.

On a CPU whose kernels read oneDNN's packed layout (``onednn_gemv_dtypes``: fp32 with AVX-512,
bf16 with AVX512-BF16), ``prepack_linear_weights`` recognises it (``onednn_layout.packed_view``)
and drops the plain weight the GEMV used to stream. On AVX2 cores a layer's packed copy is the
packed GEMM's panels (fp32, or bf16 where the weights' values are bf16), which the GEMV reads the
same way. Elsewhere the layer keeps both copies.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import NEW_TOKENS, PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.core.layers.linear import Linear
from tokenmill.plugins.platforms.cpu import onednn_layout, prepacked_linear
from tokenmill.plugins.platforms.cpu.kernels import cpu_kernels
from tokenmill.plugins.platforms.cpu.onednn_layout import packed_view
from tokenmill.plugins.platforms.cpu.prepacked_linear import PrepackedLinearMethod, prepack_linear_weights
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy

KERNELS = cpu_kernels()
#: fp32 layers pack into the packed GEMM's panels here (AVX2), not oneDNN's layout
PANELS = KERNELS is not None and KERNELS.packed_gemm_preferred()
IN_PLACE = [getattr(torch, name) for name in (KERNELS.onednn_gemv_dtypes() if KERNELS is not None else [])]


def _recognised(dtype: torch.dtype) -> bool:
    probe = torch.randn(128, 64).to(dtype)
    return packed_view(torch.ops.mkldnn._reorder_linear_weight(probe), probe) is not None


#: dtypes whose packed layout the GEMV reads on this CPU: AVX-512 (fp32) and AVX512-BF16 (bf16)
#: cores where oneDNN packs in the blocks onednn_layout.py knows (an AMX core may pack bf16
#: otherwise: there the plain copy stays, which test_mutation_... checks on every CPU)
READ_IN_PLACE = [dtype for dtype in IN_PLACE if _recognised(dtype)]
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(dtype not in READ_IN_PLACE, reason=(
    f"the GEMV does not read oneDNN's packed {dtype} on this CPU"))) for dtype in (torch.bfloat16, torch.float32)]


def linear_layer(outputs: list[int], width: int, bias: bool = True, dtype: torch.dtype = torch.bfloat16) -> Linear:
    layer = Linear(width, outputs, bias=bias, dtype=dtype)
    layer.weight.copy_(torch.randn(sum(outputs), width))
    if bias:
        layer.bias.copy_(torch.randn(sum(outputs)))
    return layer


@pytest.mark.parametrize("shape", [(2816, 1024), (1024, 2816), (128, 64), (32000, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packed_bytes_are_the_weight_in_blocks_of_rows(shape, dtype):
    weight = torch.randn(*shape).to(dtype)
    view = packed_view(torch.ops.mkldnn._reorder_linear_weight(weight), weight)
    assert view is not None and view.dim() == (4 if dtype == torch.bfloat16 else 3)
    rows = view.shape[2]
    assert view.shape[0] * rows == shape[0] and view.numel() == weight.numel()
    plain = view.transpose(1, 2).reshape(shape)  # every element where the layout says
    assert torch.equal(plain, weight)


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_on_the_packed_copy_matches_the_product(rows, bias, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(192, 320).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    b = torch.randn(192).to(dtype) if bias else None
    x = torch.randn(rows, 320).to(dtype)
    got = KERNELS.gemv(x, packed_view(packed, weight), b)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    # bf16: each product exact in fp32, fp32 sums, one bf16 rounding of the output (2^-9
    # relative); fp32: sums of 320 products of N(0, 1) values, in another order than fp64's
    tolerance = dict(rtol=8e-3, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    assert got.dtype == dtype and got.shape == (rows, 192)
    torch.testing.assert_close(got.double(), expected, **tolerance)
    assert torch.equal(got, KERNELS.gemv(x, packed_view(packed, weight), b))  # no state between calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_keeps_one_copy_and_computes_as_before(dtype):
    torch.manual_seed(0)
    layer = linear_layer([256, 128], 192, dtype=dtype)
    expected = {rows: layer(torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype))
                for rows in (1, 2, 5, 64)}
    assert prepack_linear_weights(layer, KERNELS, gemv=True) == 1
    assert not hasattr(layer, "weight") and layer.method.blocked is not None
    packed = layer.packed_weight
    start = packed.data_ptr() if packed.layout == torch.strided else torch.ops.mkldnn.data_ptr(packed)
    assert layer.method.blocked.data_ptr() == start  # the GEMV reads the GEMM's bytes, no copy of them
    tolerance = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    for rows, want in expected.items():
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
        torch.testing.assert_close(layer(x).float(), want.float(), **tolerance)


@pytest.mark.skipif(torch.bfloat16 not in READ_IN_PLACE, reason="no bf16 layer reads its packed copy here")
def test_a_weight_another_module_shares_stays_plain():
    """A tied embedding looks its rows up in the weight: the output projection keeps it."""
    layer = linear_layer([128], 64, bias=False)
    model = nn.ModuleDict({"embed": nn.Embedding(128, 64), "head": layer})
    model["embed"].weight = layer.weight
    assert prepack_linear_weights(model, KERNELS, gemv=True) == 1
    assert layer.method.blocked is None and layer.weight is model["embed"].weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_mutation_a_layout_read_wrongly_keeps_the_plain_copy(monkeypatch, dtype):
    """Blocks of 32 rows where oneDNN packed 64: the bytes do not match, so the layer keeps
    its plain weight for the GEMV and its results stay right."""
    if dtype == torch.float32 and PANELS:
        pytest.skip("fp32 layers pack into the panels here, not oneDNN's layout")
    monkeypatch.setattr(onednn_layout, "BLOCK_ROWS", (32,))
    torch.manual_seed(1)
    layer = linear_layer([256], 192, dtype=dtype)
    x = torch.randn(1, 192).to(dtype)
    expected = layer(x)
    prepack_linear_weights(layer, KERNELS, gemv=True)
    assert layer.method.blocked is None and hasattr(layer, "weight")
    torch.testing.assert_close(layer(x).float(), expected.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(torch.bfloat16 not in READ_IN_PLACE, reason="no bf16 layer reads its packed copy here")
def test_a_bf16_engine_holds_one_copy_and_matches_hf_in_bf16(model_dir):
    """The tiny Llama's layers are multiples of 64 wide: every one reads its packed copy,
    through the decode stack and the layers alike. Tolerance: bf16's (the GPU suite's rule)."""
    path = model_dir("llama")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=2**24)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(getattr(m, "method", None),
                                                                                PrepackedLinearMethod)]
    assert linears and all(m.method.blocked is not None and not hasattr(m, "weight") for m in linears)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    reference = hf_greedy(path, PROMPTS, NEW_TOKENS, dtype=torch.bfloat16)
    assert_matches_reference(reference, tokens, logprobs, tie_tolerance=0.1, logprob_tolerance=0.1)


@pytest.mark.skipif(not PANELS, reason="fp32 layers pack into the panels on AVX2 cores only")
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("outputs", [192, 80])  # 12 panels; 5 (four read at once, then one)
def test_gemv_on_the_panels_matches_the_product(rows, outputs):
    torch.manual_seed(rows)
    weight, b = torch.randn(outputs, 320), torch.randn(outputs)
    x = torch.randn(rows, 320)
    got = KERNELS.gemv(x, KERNELS.pack_gemm_weight(weight), b)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T + b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not PANELS, reason="the panels are packed on AVX2 cores only")
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("outputs", [192, 80])
def test_gemv_on_bf16_panels_matches_the_widened_weight(rows, outputs):
    """bf16 panels under fp32 x (a bf16 checkpoint computed in fp32): the fp32 GEMV of the
    widened weight, bit for bit (widening is exact, the sums run in the same order); under
    bf16 x (a bf16 model on a core without bf16 arithmetic), the product up to bf16 rounding."""
    torch.manual_seed(rows)
    weight, b = torch.randn(outputs, 320).bfloat16(), torch.randn(outputs)
    x = torch.randn(rows, 320)
    panels = KERNELS.pack_gemm_weight(weight)
    assert panels.dtype == torch.bfloat16
    got = KERNELS.gemv(x, panels, b)
    assert torch.equal(got, KERNELS.gemv(x, KERNELS.pack_gemm_weight(weight.float()), b))
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T + b.double(), rtol=1e-5, atol=1e-4)
    narrow = KERNELS.gemv(x.bfloat16(), panels, b.bfloat16())
    assert narrow.dtype == torch.bfloat16
    torch.testing.assert_close(narrow.double(), x.bfloat16().double() @ weight.double().T + b.bfloat16().double(),
                               rtol=8e-3, atol=8e-3)


@pytest.mark.skipif(not PANELS, reason="the panels are packed on AVX2 cores only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_weights_keep_one_bf16_copy_in_the_panels(dtype):
    """An fp32 layer whose weights are all bf16 values (a bf16 checkpoint computed in fp32), or
    a bf16 layer on a core without bf16 arithmetic: bf16 panels, read by the GEMV in place and
    widened by the GEMM, and no plain copy; the fp32 layer's results are the unpacked layer's
    at every row count (the GEMV's 1-5, the GEMM's widened as it reads under 64 rows and
    widened a panel at a time above)."""
    torch.manual_seed(3)
    layer = linear_layer([256, 128], 192, dtype=dtype)
    layer.weight.copy_(layer.weight.bfloat16())
    inputs = {rows: torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
              for rows in (1, 2, 5, 63, 64, 400)}
    expected = {rows: layer(x) for rows, x in inputs.items()}
    assert prepack_linear_weights(layer, KERNELS, gemv=True, widen_bf16=dtype == torch.bfloat16) == 1
    assert not hasattr(layer, "weight") and layer.packed_weight.dtype == torch.bfloat16
    assert layer.method.blocked is layer.packed_weight
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for rows, x in inputs.items():
        torch.testing.assert_close(layer(x), expected[rows], **tolerance)


@pytest.mark.skipif(not PANELS, reason="fp32 layers pack into the panels on AVX2 cores only")
def test_a_padded_panel_keeps_the_plain_copy():
    """200 outputs fill 12.5 panels of 16: the GEMV writes every row of every panel, so the
    layer keeps its plain weight for it."""
    layer = linear_layer([200], 64, dtype=torch.float32)
    x = torch.randn(1, 64)
    expected = layer(x)
    prepack_linear_weights(layer, KERNELS, gemv=True)
    assert layer.method.blocked is None and hasattr(layer, "weight")
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not PANELS, reason="fp32 layers pack into the panels on AVX2 cores only")
def test_mutation_a_padded_panel_read_in_place_gives_a_wrong_width(monkeypatch):
    monkeypatch.setattr(prepacked_linear, "_panels_view", lambda panels, weight: panels)
    layer = linear_layer([200], 64, bias=False, dtype=torch.float32)  # with a bias, its size check refuses
    prepack_linear_weights(layer, KERNELS, gemv=True)
    assert layer(torch.randn(1, 64)).shape[-1] == 208

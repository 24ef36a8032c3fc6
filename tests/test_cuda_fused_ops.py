"""The cuda platform's elementwise CustomOps (tokenmill.plugins.platforms.cuda.fused_ops), run
on the CPU in Triton's interpreter against each layer's ``forward_native``.

fp32 and fp16 are checked tightly: numpy rounds fp32 -> fp16 to nearest as a GPU does, so an
fp16 result that leaves out one of eager's intermediate roundings shows as many elements a
last bit off. bf16 is checked loosely here: numpy has no bf16, and the interpreter truncates
fp32 -> bf16 where a GPU rounds, so each cast may be an ulp off (tests/gpu/test_cuda_kernels.py
checks bf16 on a GPU). Every family's engine on the CUDA stand-in runs these ops at HF parity
(tests/test_device_boundaries.py); here each op's shapes, strides and fallbacks.
"""

from __future__ import annotations

import inspect
import linecache
import textwrap

import pytest
import torch

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.custom_op import dispatch_custom_ops
from tokenmill.core.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.core.layers.rotary import ApplyRotary
from tokenmill.plugins.platforms.cuda import fused_ops
from tokenmill.plugins.platforms.cuda.fused_ops import (
    FUSED_OPS,
    act_and_mul,
    rms_norm,
    rotary_embedding,
)
from tokenmill.plugins.platforms.cuda.platform import CudaPlatform
from tokenmill.testing.device_graphs import HostSyncCheck

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (share of elements allowed to differ from eager, by at most this many ulps) per dtype;
#: fp32 differs only in the order of its sums, so it is bounded by rtol instead
EXACTNESS = {torch.float16: (0.01, 1), torch.bfloat16: (1.0, 2)}


def assert_like_eager(got: torch.Tensor, expected: torch.Tensor, share: float | None = None) -> None:
    """``got`` within the dtype's bound of ``expected`` (see EXACTNESS)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    dtype = got.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
        return
    allowed_share, ulps = EXACTNESS[dtype]
    eps = torch.finfo(dtype).eps
    diff = (got.float() - expected.float()).abs()
    # one ulp of a value in [2^e, 2^(e+1)) is eps * 2^e <= eps * |value|; tiny values by atol
    # (bf16: the truncated terms of a sum that cancels are each off by their own ulps, so the
    # bound is the row's scale)
    atol = ulps * eps * expected.abs().max().item() if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.float(), expected.float(), rtol=ulps * eps, atol=atol)
    differing = (diff > 0).float().mean().item()
    assert differing <= (allowed_share if share is None else share), f"{differing:.1%} of the elements differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 72, 4096, 9000])  # 9000: wider than one tile, two passes
@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_matches_eager(norm, dtype, hidden):
    """Llama's weight * (x / rms).to(dtype), Gemma's (x / rms) * (1 + weight) rounded once."""
    torch.manual_seed(hidden)
    layer = norm(hidden, 1e-5, dtype)
    layer.weight.data.normal_(1 if norm is RMSNorm else 0, 0.2)
    x = torch.randn(5, hidden, dtype=dtype) * 3
    assert_like_eager(rms_norm(layer, x), layer.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [72, 4096, 9000])
@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_with_the_residual_add_matches_eager(norm, dtype, hidden):
    """``norm(x, residual)``: the sum rounded to the dtype as the eager add rounds it (equal to
    it where the interpreter rounds as a GPU does: not bf16, which numpy truncates), and the norm
    of that sum, in one kernel; two passes over a row wider than a tile."""
    torch.manual_seed(hidden + 1)
    layer = norm(hidden, 1e-5, dtype)
    layer.weight.data.normal_(1 if norm is RMSNorm else 0, 0.2)
    x, residual = torch.randn(5, hidden, dtype=dtype) * 3, torch.randn(5, hidden, dtype=dtype) * 3
    normed, total = rms_norm(layer, x, residual)
    expected_normed, expected_total = layer.forward_native(x, residual)
    if dtype == torch.bfloat16:
        assert_like_eager(total, expected_total)
    else:
        assert torch.equal(total, expected_total)
    assert_like_eager(normed, expected_normed)


def test_rms_norm_of_strided_head_views():
    """Qwen3's q/k norms: [tokens, heads, head_dim] views of a fused qkv output (not one row stride)."""
    torch.manual_seed(1)
    layer = RMSNorm(32, 1e-6, torch.float16)
    layer.weight.data.normal_(1, 0.2)
    qkv = torch.randn(3, 7 * 32, dtype=torch.float16)
    q = qkv[:, :4 * 32].view(3, 4, 32)
    before = qkv.clone()
    assert_like_eager(rms_norm(layer, q), layer.forward_native(q))
    assert torch.equal(qkv, before)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-x) = inf: the activation is -0
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_gated_activations_match_eager(dtype, name):
    """1100 columns: a full tile and a partial one. GELU's tail (x below about -3) is computed
    without the cancellation in torch's ``1 + tanh``, so more of its fp16 values differ there
    (by at most an ulp, of values below 1e-3)."""
    torch.manual_seed(2)
    layer = GatedActivation(name)
    x = torch.randn(2, 3, 2 * 1100, dtype=dtype) * 3
    share = 0.08 if name.startswith("gelu") and dtype == torch.float16 else None
    assert_like_eager(act_and_mul(layer, x), layer.forward_native(x), share)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim,head_dim", [(64, 64), (32, 80)])  # full, and Phi's partial rotary
def test_rotary_rotates_views_of_a_fused_qkv_in_place(dtype, rotary_dim, head_dim):
    """Six query heads, two KV heads (GQA), as views of one qkv row: q and k rotated in place
    as eager rotates them, v untouched."""
    torch.manual_seed(rotary_dim)
    layer = ApplyRotary(rotary_dim)
    tokens = 7
    qkv = torch.randn(tokens, 10 * head_dim, dtype=dtype)
    q, k = qkv[:, :6 * head_dim].view(tokens, 6, head_dim), qkv[:, 6 * head_dim:8 * head_dim].view(tokens, 2, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2) * 6.3
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    want_q, want_k = layer.forward_native(q.clone(), k.clone(), cos, sin)
    v = qkv[:, 8 * head_dim:].clone()
    got_q, got_k = rotary_embedding(layer, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_like_eager(got_q, want_q)
    assert_like_eager(got_k, want_k)
    assert torch.equal(qkv[:, 8 * head_dim:], v)


def test_empty_batches_and_what_the_kernels_do_not_take_go_to_eager():
    norm = RMSNorm(16, 1e-6, torch.float32)
    assert rms_norm(norm, torch.empty(0, 16)).shape == (0, 16)
    # mixed dtypes: eager's promotion rules, not a kernel's
    x = torch.randn(3, 16, dtype=torch.float16)
    assert torch.equal(rms_norm(norm, x), norm.forward_native(x))
    rotary = ApplyRotary(8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.float16)
    got = rotary_embedding(rotary, q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, rotary.forward_native(q, k, cos, sin)))
    assert act_and_mul(GatedActivation("silu"), torch.empty(0, 8)).shape == (0, 4)


def test_the_cuda_platform_dispatches_every_elementwise_op_of_the_gated_families():
    """What the families' layers are (their op names) is what the platform answers for."""
    model = torch.nn.ModuleList([RMSNorm(8, 1e-6, torch.float32), GemmaRMSNorm(8, 1e-6, torch.float32),
                                 ApplyRotary(8), GatedActivation("silu"), GatedActivation("gelu_pytorch_tanh"),
                                 GatedActivation("gelu_new")])
    assert dispatch_custom_ops(model, CudaPlatform.__new__(CudaPlatform), lambda op: True) == 6
    assert [m.op_impl for m in model] == [rms_norm, rms_norm, rotary_embedding, act_and_mul, act_and_mul, act_and_mul]
    assert FUSED_OPS.get(GatedActivation("relu").op_name) is None  # no kernel: eager


def test_the_ops_read_nothing_back_from_the_device():
    """A CUDA graph records them: no host synchronisation in their host code."""
    norm, act, rotary = RMSNorm(16, 1e-6, torch.float32), GatedActivation("silu"), ApplyRotary(8)
    with HostSyncCheck():
        rms_norm(norm, torch.randn(3, 16))
        act_and_mul(act, torch.randn(3, 16))
        rotary_embedding(rotary, torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 8), torch.randn(3, 8))


def _rms_norm_case():
    layer = RMSNorm(4096, 1e-5, torch.float16)
    layer.weight.data.normal_(1, 0.2)
    x = torch.randn(5, 4096, dtype=torch.float16) * 3
    return rms_norm(layer, x), layer.forward_native(x)


def _silu_case():
    layer, x = GatedActivation("silu"), torch.randn(4, 2 * 1024, dtype=torch.float16) * 3
    return act_and_mul(layer, x), layer.forward_native(x)


def _rotary_case():
    layer = ApplyRotary(64)
    q, k = torch.randn(8, 4, 64, dtype=torch.float16), torch.randn(8, 2, 64, dtype=torch.float16)
    angles = torch.rand(8, 32) * 6.3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).half() for f in (torch.cos, torch.sin))
    want = layer.forward_native(q.clone(), k.clone(), cos, sin)[0]
    return rotary_embedding(layer, q, k, cos, sin)[0], want


def _residual_case():
    layer = RMSNorm(4096, 1e-5, torch.float16)
    layer.weight.data.normal_(1, 0.2)
    x, residual = torch.randn(5, 4096, dtype=torch.float16) * 3, torch.randn(5, 4096, dtype=torch.float16) * 3
    return rms_norm(layer, x, residual)[0], layer.forward_native(x, residual)[0]


@pytest.mark.parametrize("kernel,case", [("_scaled", _rms_norm_case), ("_act_and_mul_kernel", _silu_case),
                                         ("_rotate_heads", _rotary_case), ("_row_values", _residual_case)])
def test_mutation_a_missing_intermediate_rounding_fails(kernel, case, monkeypatch):
    """Eager rounds to the dtype after the normalisation, after the activation, after each
    rotary product and after the residual add; a kernel that rounds once at the end differs in the last bit of many fp16
    values, which the fp16 checks above see."""
    monkeypatch.setattr(fused_ops, kernel, _without_rounding(getattr(fused_ops, kernel).fn))
    torch.manual_seed(3)
    with pytest.raises(AssertionError):  # too many values off by an ulp, or a value off by more
        assert_like_eager(*case())


def _without_rounding(fn):
    """``fn``'s Triton kernel with every ``.to(dtype).to(tl.float32)`` (a rounding to the
    compute dtype) taken out."""
    source = textwrap.dedent(inspect.getsource(fn))
    mutated = source.replace(".to(dtype).to(tl.float32)", "")
    assert mutated != source
    path = f"<{fn.__name__} without its roundings>"
    linecache.cache[path] = (len(mutated), None, mutated.splitlines(True), path)  # Triton reads the source
    namespace = dict(fn.__globals__)
    exec(compile(mutated, path, "exec"), namespace)
    return namespace[fn.__name__]

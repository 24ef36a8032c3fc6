"""On a CUDA GPU: the Triton attention kernels (compiled, not interpreted) equal the torch
reference at serving shapes, and the engine's speculative and plain decoding agree there; the
fused MoE path equals the loop path, replays from a CUDA graph, and decodes Mixtral alike."""

from __future__ import annotations

import pytest
import torch

from conftest import NEW_TOKENS, PROMPTS
from cuda_engines import cuda_llm
from tokenmill import SamplingParams
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention
from tokenmill.plugins.models.triton_moe import fused_moe
from tokenmill.plugins.platforms.cuda.fused_ops import act_and_mul
from tokenmill.testing.attention_conformance import AttentionCase, check_backend

#: Llama-3-8B-like (32q / 8kv x 128), Qwen2-7B-like (28 / 4 x 128), Gemma-2-like windows and
#: soft caps; prefill chunks of 512 on cached prefixes, decodes over 4k contexts; fp16 over a bf16 cache
SERVING = [
    AttentionCase(0, 32, 8, 128, 16, torch.bfloat16, ((0, 512), (1024, 512), (4000, 1), (2048, 1), (0, 1))),
    AttentionCase(1, 28, 4, 128, 16, torch.float16, ((3000, 1),) * 8 + ((0, 300),)),
    AttentionCase(2, 16, 8, 256, 32, torch.bfloat16, ((4096, 1), (100, 700)), sliding_window=4096, soft_cap=50.0),
    # an fp16 model's K/V kept in bf16; a short decode beside a long one leaves most splits empty
    AttentionCase(3, 32, 8, 128, 16, torch.float16, ((3000, 1), (40, 1), (0, 300)), cache_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", SERVING, ids=str)
def test_triton_attention_matches_the_reference_at_serving_shapes(case):
    check_backend(TritonPagedAttention(), case, device="cuda")


@pytest.mark.gpu_alone  # 8.6 GB of cache, kept out of the other workers' memory budgets
def test_triton_attention_reaches_a_cache_past_int32_offsets():
    """The serving case's blocks at the top of a per-layer cache past 2**31 elements a K/V half
    (a model of few layers on 80 GB): block offsets computed in 32 bits would be an illegal
    address."""
    check_backend(TritonPagedAttention(), SERVING[0], device="cuda", past_int32=True)


@pytest.mark.parametrize("tokens", [1, 16, 600])  # the small tiles (decode) and the large ones
def test_fused_moe_matches_the_loop_path_and_replays_in_a_cuda_graph(tokens):
    """Mixtral-like experts scaled down (8 experts, top-2, 1024 -> 3584): both paths round each
    GEMM's output to bf16 after different accumulation orders, so they agree to a few bf16 ulps."""
    torch.manual_seed(0)
    moe = FusedMoE(8, 2, 1024, 3584, True, "silu", torch.bfloat16).cuda()
    moe.act_and_mul.op_impl = act_and_mul  # as the cuda platform dispatches it: both paths, and the graph
    for param in moe.parameters():
        param.normal_(0, param.shape[-1] ** -0.5)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fused_moe(moe, x), moe.forward_native(x), rtol=0.03, atol=0.03)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails on any host sync
        out = fused_moe(moe, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, moe.forward_native(x), rtol=0.03, atol=0.03)


def test_mixtral_decodes_alike_on_the_fused_and_loop_moe_paths(model_dir):
    """Eager (no graphs), each MoE layer set to one path, then the other: the same greedy
    tokens up to a near-tie, chosen-token logprobs within 1e-3. In fp32 (IEEE dots in the fused
    kernels): in bf16 the two paths' sums, rounded apart, reach a later layer's router, and
    where its top-2 nearly tie they route a token to other experts (seen on an H200: the same
    token, 0.31 off in logprob), which is the arithmetic's, not the kernels'."""
    llm = cuda_llm(model_dir("mixtral"), dtype="float32", enforce_eager=True)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = []
    for impl in (fused_moe, None):
        for layer in layers:
            layer.op_impl = impl
        runs.append(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False))
    for fused, loop in zip(*runs):
        for step, (a, b, entries) in enumerate(zip(fused.outputs[0].token_ids, loop.outputs[0].token_ids,
                                                   loop.outputs[0].logprobs)):
            if a != b:  # a divergence only where the loop path's top two were within 1e-3
                top = sorted((e.logprob for e in entries.values()), reverse=True)
                assert top[0] - top[1] <= 1e-3, f"diverges at step {step} on no tie"
                break
            assert abs(fused.outputs[0].logprobs[step][a].logprob - entries[b].logprob) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_elementwise_ops_match_eager_and_replay_in_a_cuda_graph(dtype):
    """The cuda platform's RMSNorm (Llama's and Gemma's, alone and with the residual add),
    SiLU/GELU-and-mul and rotary kernels against each layer's eager code at Llama-3-8B's widths:
    a GPU rounds fp32 -> bf16 to nearest,
    as torch does, so the two agree to the last bit but for a reduction's order or ``exp``'s
    last bits (an ulp of an intermediate, in a small share of the values; GELU's tail below -3,
    where torch's ``1 + tanh`` cancels, in more of them). Then the same calls replay from a graph."""
    from tokenmill.core.layers.activation import GatedActivation
    from tokenmill.core.layers.norm import GemmaRMSNorm, RMSNorm
    from tokenmill.core.layers.rotary import ApplyRotary
    from tokenmill.plugins.platforms.cuda.fused_ops import act_and_mul, rms_norm, rotary_embedding

    torch.manual_seed(0)
    tokens, hidden, head = 300, 4096, 128
    eps = torch.finfo(dtype).eps
    norms = [RMSNorm(hidden, 1e-5, dtype).cuda(), GemmaRMSNorm(hidden, 1e-5, dtype).cuda()]
    for norm in norms:
        norm.weight.data.normal_(1 if isinstance(norm, RMSNorm) else 0, 0.2)
    acts = [GatedActivation("silu"), GatedActivation("gelu_pytorch_tanh")]
    rotary = ApplyRotary(head)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype) * 3
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype) * 3
    gate_up = torch.randn(tokens, 2 * 14336, device="cuda", dtype=dtype) * 3
    qkv = torch.randn(tokens, (32 + 8 + 8) * head, device="cuda", dtype=dtype)
    angles = torch.rand(tokens, head // 2, device="cuda") * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))

    def fused():
        q, k = qkv[:, :32 * head].view(tokens, 32, head), qkv[:, 32 * head:40 * head].view(tokens, 8, head)
        q_in, k_in = q.clone(), k.clone()
        rotated = rotary_embedding(rotary, q_in, k_in, cos, sin)
        return ([rms_norm(n, x) for n in norms] + [act_and_mul(a, gate_up) for a in acts] + list(rotated)
                + [out for n in norms for out in rms_norm(n, x, residual)])

    def eager():
        q, k = qkv[:, :32 * head].view(tokens, 32, head), qkv[:, 32 * head:40 * head].view(tokens, 8, head)
        return ([n.forward_native(x) for n in norms] + [a.forward_native(gate_up) for a in acts]
                + list(rotary.forward_native(q, k, cos, sin))
                + [out for n in norms for out in n.forward_native(x, residual)])

    def check(got, want):
        for index, (a, b) in enumerate(zip(got, want)):
            # an ulp of an intermediate (the activation, before ``* up``) is several of the result's
            torch.testing.assert_close(a.float(), b.float(), rtol=4 * eps, atol=1e-5,
                                       msg=lambda m, i=index: f"output {i}: {m}")
            share = (a != b).float().mean().item()
            assert share <= (0.1 if index == 3 else 0.01), f"output {index}: {share:.1%} of the values differ"
        # the residual stream (the sums of the fused adds) is the eager add's, to the bit
        assert torch.equal(got[7], want[7]) and torch.equal(got[9], want[9])

    check(fused(), eager())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fused()
    for tensor in (x, residual, gate_up, qkv):
        tensor.copy_(torch.randn_like(tensor) * 3)
    graph.replay()
    check(outputs, eager())

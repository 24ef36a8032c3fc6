"""The CPU fast paths (prepacked GEMM weights, fused C++ layer ops) equal the eager modules,
and ``compilation_config: {"custom_ops": ["none"]}`` turns them all off; ``enforce_eager``
keeps them (it is about CUDA graphs, as in vLLM)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NEW_TOKENS, PLAIN, PROMPTS, greedy_in_batches, make_llm
from tokenmill import SamplingParams
from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.rotary import ApplyRotary, RotaryEmbedding
from tokenmill.plugins.platforms.cpu import cache_size, decode_stack
from tokenmill.plugins.platforms.cpu.decode_stack import DecodeStack
from tokenmill.plugins.platforms.cpu.dtypes import native_bf16
from tokenmill.plugins.platforms.cpu.fused_ops import FUSED_OPS
from tokenmill.plugins.platforms.cpu.kernels import cpu_kernels
from tokenmill.plugins.platforms.cpu.prepacked_linear import PrepackedLinearMethod, prepack_linear_weights
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy
from tokenmill.testing.tiny_models import make_tiny_model

KERNELS = cpu_kernels()
#: AVX2 cores: the GEMV reads the packed GEMM's panels in place, and takes up to 5 rows
PANELS = KERNELS is not None and KERNELS.packed_gemm_preferred()


def test_kernels_build_here():
    """CI machines have a compiler: a silent fallback would hide a slow engine."""
    assert KERNELS is not None


def test_a_kernel_build_logs_its_progress(tmp_path):
    """While the kernels build, a line every interval with the elapsed time and the units
    finished, then the total: a first start does not look hung."""
    from structlog.testing import capture_logs

    from tokenmill.plugins.platforms.cpu.kernels import build_progress

    with capture_logs() as logs:
        with build_progress(tmp_path, 2, every=0.05):
            time.sleep(0.12)
            (tmp_path / "bindings.o").write_bytes(b"")
            time.sleep(0.12)
    progress = [entry for entry in logs if entry["event"] == "compiling the C++ CPU kernels"]
    assert len(progress) >= 3
    assert progress[0]["units_done"] == "0/2" and progress[-1]["units_done"] == "1/2"
    assert logs[-1]["event"] == "compiled the C++ CPU kernels" and logs[-1]["seconds"] >= 0.2


def test_a_kernel_build_belongs_to_one_torch(monkeypatch):
    """The build directory is keyed by torch's version: a module built against one torch's
    headers is never loaded by another, and two environments do not rebuild each other's."""
    from tokenmill.plugins.platforms.cpu.kernels import _build_digest

    here = _build_digest()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert _build_digest() != here


def test_kernel_sources_ship_in_the_wheel():
    """The kernels build from their sources at first use, so an installed (non-editable)
    tokenmill must carry every file under csrc/: the package-data globs must match them all."""
    import fnmatch
    import tomllib
    from pathlib import Path

    import tokenmill.plugins.platforms.cpu.kernels as kernels

    root = Path(__file__).parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs.get(kernels.__name__, [])
    package_dir = Path(kernels.__file__).parent
    for source in (package_dir / "csrc").iterdir():
        relative = source.relative_to(package_dir).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def assert_equals_eager(got: torch.Tensor, expected: torch.Tensor, atol: float, bf16_steps: int = 1) -> None:
    """fp32: equal up to evaluation order; bf16: at most ``bf16_steps`` rounding steps apart."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=atol)
    else:
        steps = (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs().max()
        assert int(steps) <= bf16_steps


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), hidden=st.sampled_from([8, 16, 48, 64, 100, 512]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_rms_norm_equals_eager(rows, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    eager = RMSNorm(hidden, 1e-6, dtype)
    eager.weight.copy_(torch.randn(hidden, generator=g))
    fused = RMSNorm(hidden, 1e-6, dtype)
    fused.weight.copy_(eager.weight)
    fused.op_impl = FUSED_OPS["rms_norm"]
    # HF's RMSNorm rounds the normalised value to bf16 and then its product with the weight;
    # the kernel rounds the product once: two roundings against one can land two bf16 steps
    # apart (one element in about 3,000 random cases of these shapes)
    assert_equals_eager(fused(x), eager(x), atol=1e-6, bf16_steps=2)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), d=st.sampled_from([4, 16, 24, 64, 1408]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_silu_and_mul_equals_eager(rows, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * d, generator=g) * 4).to(dtype)
    eager, fused = GatedActivation("silu"), GatedActivation("silu")
    fused.op_impl = FUSED_OPS[fused.op_name]
    assert_equals_eager(fused(x), eager(x), atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 20), rope=st.sampled_from([{"rope_type": "default", "rope_theta": 10000.0},
                                                       {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}]),
       partial=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       head_dim=st.sampled_from([32, 96]))
def test_fused_rotary_equals_eager(tokens, rope, partial, dtype, seed, head_dim):
    """In place on strided q/k views of a fused qkv output, as the model calls it. Halves of 8
    to 48 features: the kernel's vector loop (16 lanes at a time), its scalar tail, and both."""
    heads, kv_heads = 4, 2
    rope = {**rope, "partial_rotary_factor": 0.5} if partial else rope
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 2000, (tokens,), generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def views(t):
        q, k, _ = t.split(split, dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    frequencies = RotaryEmbedding(head_dim, rope, 2048)
    cos_sin = frequencies(positions, dtype)
    eager, fused = ApplyRotary(frequencies.rotary_dim), ApplyRotary(frequencies.rotary_dim)
    fused.op_impl = FUSED_OPS["rotary_embedding"]
    expected_q, expected_k = eager(*views(qkv.clone()), *cos_sin)
    got_q, got_k = fused(*views(qkv), *cos_sin)
    assert_equals_eager(got_q, expected_q, atol=1e-6)
    assert_equals_eager(got_k, expected_k, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 64, 300])
def test_prepacked_linear_equals_f_linear(dtype, rows):
    torch.manual_seed(rows)
    # sums of 200 products of N(0, 1) values (|y| ~ 14): summation order moves the last fp32 bits
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    # oneDNN's packing only / this CPU's GEMM choice / that plus the plain weight for 1-2 rows (GEMV)
    for kernels, gemv in ((None, False), (KERNELS, False), (KERNELS, True)):
        layer = Linear(200, [64, 37], bias=True, dtype=dtype)  # widths off the kernels' vector steps
        layer.weight.copy_(torch.randn(101, 200))
        layer.bias.copy_(torch.randn(101))
        x = torch.randn(rows, 200).to(dtype)
        expected = layer(x)
        # as the platform packs them: bf16 widened to fp32 GEMMs on a CPU without bf16 arithmetic
        assert prepack_linear_weights(layer, kernels, gemv=gemv, widen_bf16=not native_bf16()) == 1
        assert isinstance(layer.method, PrepackedLinearMethod)
        assert hasattr(layer, "weight") == gemv
        torch.testing.assert_close(layer(x), expected, **tolerance)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 7, 13, 64, 131, 389, 901])
@pytest.mark.parametrize("shape", [(200, 101), (64, 32), (7, 1), (512, 300)])
def test_packed_gemm_equals_f_linear(rows, shape):
    """The panel GEMM (used on AVX2-only CPUs, tested on every CPU): every row-tile tail
    (1-5 of 6 rows, 13 of 14), more rows than one chunk of 384 (AVX2) or 896 (AVX-512) with a
    partial last chunk, output widths off the panel width and a single column, with and
    without bias, x with leading dimensions."""
    torch.manual_seed(rows)
    k, n = shape
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    packed = KERNELS.pack_gemm_weight(weight)
    for b in (None, bias):
        got = KERNELS.packed_gemm(x, packed, n, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(x.double(), weight.double(),
                                                                    None if b is None else b.double()).float(),
                                   rtol=1e-5, atol=1e-4)
    three_d = KERNELS.packed_gemm(x.view(1, rows, k), packed, n, None)
    assert three_d.shape == (1, rows, n)
    torch.testing.assert_close(three_d[0], KERNELS.packed_gemm(x, packed, n, None), rtol=0, atol=0)
    assert KERNELS.packed_gemm(x[:0], packed, n, None).shape == (0, n)
    with pytest.raises(RuntimeError, match="features"):
        KERNELS.packed_gemm(torch.randn(rows, k + 1), packed, n, None)
    with pytest.raises(RuntimeError, match="pack_gemm_weight"):
        KERNELS.packed_gemm(x, packed, n + 64, None)


@pytest.mark.parametrize("rows", [1, 5, 63, 64, 131, 389, 901])
@pytest.mark.parametrize("shape", [(200, 101), (512, 300)])
def test_packed_gemm_on_bf16_panels_equals_the_widened_fp32_panels(rows, shape):
    """bf16 panels (a bf16 checkpoint computed in fp32) give the fp32 panels' result bit for
    bit: widening bf16 is exact, whether the tile widens each weight as it reads it (chunks
    under 64 rows) or a panel is widened first (64 rows and more, the last chunk's tail of a
    longer input included)."""
    torch.manual_seed(rows)
    k, n = shape
    weight, bias, x = torch.randn(n, k).bfloat16(), torch.randn(n), torch.randn(rows, k)
    panels = KERNELS.pack_gemm_weight(weight)
    assert panels.dtype == torch.bfloat16 and panels.shape == KERNELS.pack_gemm_weight(weight.float()).shape
    for b in (None, bias):
        assert torch.equal(KERNELS.packed_gemm(x, panels, n, b),
                           KERNELS.packed_gemm(x, KERNELS.pack_gemm_weight(weight.float()), n, b))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("width", [200, 512])
@pytest.mark.parametrize("outputs", [3, 101])
def test_gemv_widens_bf16_weights_under_fp32_activations(rows, width, outputs):
    """fp32 x against a bf16 weight: the fp32 GEMV of the widened weight (widening bf16 is
    exact) and F.linear's result, up to summation order. Output counts below and off the
    number of weight streams (1 row: 4 at once on AVX2) or weight rows a block (2-8 rows: 4 or
    2) leave rows to the one-row pass."""
    torch.manual_seed(rows)
    weight = torch.randn(outputs, width).to(torch.bfloat16)
    bias, x = torch.randn(outputs), torch.randn(rows, width)
    got = KERNELS.gemv(x, weight, bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, KERNELS.gemv(x, weight.float(), bias), rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="dtype"):
        KERNELS.gemv(x.to(torch.bfloat16), weight.float(), None)  # only bf16 under fp32 widens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gemv_takes_1_to_8_rows(dtype, rows):
    """Every row count the decode stack passes (decode rows, a verify step's k + 1), widths off
    the vector step and output counts off the weight-row blocks, against F.linear in fp64."""
    torch.manual_seed(rows)
    weight, bias, x = (torch.randn(103, 200).to(dtype), torch.randn(103).to(dtype), torch.randn(rows, 200).to(dtype))
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-1)
    torch.testing.assert_close(KERNELS.gemv(x, weight, bias).double(), expected, **tolerance)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        KERNELS.gemv(torch.randn(9, 200).to(dtype), weight, None)


def test_custom_ops_none_keeps_plain_modules_and_enforce_eager_does_not(model_dir):
    """custom_ops ["none"]: no packed weights, no fused kernels anywhere in the model. vLLM's
    enforce_eager is about CUDA graphs only: a user who passes it from habit keeps the kernels."""
    model = make_llm(model_dir("llama"), **PLAIN).llm_engine.runner.model
    assert all(not hasattr(m, "packed_weight") for m in model.modules())
    assert all(getattr(m, "op_impl", None) is None for m in model.modules())
    assert model.model.fused_decoder is None
    for args in ({}, {"enforce_eager": True}):
        fast = make_llm(model_dir("llama"), **args).llm_engine.runner.model
        assert any(hasattr(m, "packed_weight") for m in fast.modules())
        assert any(isinstance(m, RMSNorm) and m.op_impl is not None for m in fast.modules())


@pytest.mark.parametrize("custom_ops,dispatched", [
    (["-rms_norm"], {"silu_and_mul", "rotary_embedding"}),
    (["none", "+rms_norm"], {"rms_norm"}),
    (["all", "-silu_and_mul", "-rotary_embedding"], {"rms_norm"}),
])
def test_custom_ops_turn_single_ops_on_and_off_by_vllms_names(custom_ops, dispatched, model_dir):
    """vLLM's grammar: "+op" and "-op" over the default ("all"), or over "none"; the unfused
    decode stack then (it would run every op fused)."""
    llm = make_llm(model_dir("llama"), compilation_config={"custom_ops": custom_ops}, max_num_seqs=2)
    model = llm.llm_engine.runner.model
    assert {m.op_name for m in model.modules() if getattr(m, "op_impl", None) is not None} == dispatched
    assert model.model.fused_decoder is None
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    reference = hf_greedy(model_dir("llama"), PROMPTS[:2], NEW_TOKENS)
    assert_matches_reference(reference, [o.outputs[0].token_ids for o in outputs],
                             [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                              for o in outputs])


def test_custom_ops_naming_an_op_the_model_lacks_is_a_warning(model_dir):
    """vLLM's op names and a model's may differ ("gelu_and_mul" is Gemma's gelu_pytorch_tanh_and_mul
    here): a name that turns nothing off says so, with the model's own names."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        make_llm(model_dir("llama"), compilation_config={"custom_ops": ["-gelu_and_mul", "-rms_norm"]})
    [warning] = [entry for entry in logs if entry["event"].startswith("compilation_config.custom_ops names ops")]
    assert warning["unknown"] == ["gelu_and_mul"] and "silu_and_mul" in warning["model_ops"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_and_plain_engines_match_hf_alike(arch, model_dir, hf_reference):
    """Both engines meet the fp32 parity standard, so every fast path is proven against HF."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for args in ({}, PLAIN):
        outputs = make_llm(model_dir(arch), **args).generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
        assert_matches_reference(hf_reference(arch), tokens, logprobs)


def test_num_threads_sets_torch_threads(model_dir):
    """num_threads is applied when the engine is built (benchmarks pin 1 thread this way)."""
    before = torch.get_num_threads()
    try:
        make_llm(model_dir("llama"), num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernels_run_on_torchs_threads(threads):
    """The C++ kernels parallelise over the threads torch is set to (``--num-threads``).
    at::parallel_for is inlined into the kernels' build, so a build without OpenMP runs every
    kernel on one thread while oneDNN's GEMMs use all of them: W1 52M fp32 then scaled 1.28x
    from 1 to 2 threads, its decode attention not at all."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert KERNELS.parallel_threads() == threads
    finally:
        torch.set_num_threads(before)


def _count_stack_calls(llm, monkeypatch) -> list[int]:
    """Counters of the decode stack's calls (the engine's model must have a stack): decode
    steps, and steps with several query rows for a request (verify steps; prompt steps of a
    few tokens, such as the uncached tail of a prompt)."""
    assert isinstance(llm.llm_engine.runner.model.model.fused_decoder, DecodeStack)
    calls = [0, 0]
    forward = DecodeStack.__call__

    def counted(self, x, cos_sin, metadata):
        calls[metadata.max_query_len > 1] += 1
        return forward(self, x, cos_sin, metadata)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return calls


# plain Llama, q/k/v biases with MQA and a head_dim of its own, a sliding window, partial rotary
@pytest.mark.parametrize("arch", ["llama", "llama-mqa-bias", "mistral", "phi3-partial-rotary"])
def test_decode_stack_at_batch_1_and_2_matches_hf(arch, model_dir, monkeypatch):
    """Decode steps of 1 and 2 rows (and 4 on AVX2 cores, where the GEMV reads the panels) run
    all layers in one C++ call (counted), and meet the fp32 parity standard against HF; the
    window of 24 is passed by the longer prompts."""
    llm = make_llm(model_dir(arch))
    calls = _count_stack_calls(llm, monkeypatch)
    prompts = PROMPTS[:4]
    reference = hf_greedy(model_dir(arch), prompts, NEW_TOKENS)
    for batch in (1, 2, 4):
        before = calls[0]
        assert_matches_reference(reference, *greedy_in_batches(llm, prompts, batch))
        stacked = batch <= 2 or PANELS
        assert calls[0] - before == (len(prompts) // batch * (NEW_TOKENS - 1) if stacked else 0)


def test_decode_stack_is_bit_identical_to_the_layers_in_bf16(model_dir, monkeypatch):
    """bf16 rounds at every step, so equal outputs show the stack runs the layers' kernels
    in the layers' order (the layer path is taken by removing the stack)."""
    llm = make_llm(model_dir("llama"), dtype="bfloat16")
    calls = _count_stack_calls(llm, monkeypatch)
    fused = greedy_in_batches(llm, PROMPTS[:4], 2)
    assert calls[0] == 2 * (NEW_TOKENS - 1)
    llm.llm_engine.runner.model.model.fused_decoder = None
    assert greedy_in_batches(llm, PROMPTS[:4], 2) == fused


# plain Llama, q/k/v biases with MQA, a sliding window (24) that the longer prompts pass, partial
# rotary; head sizes of 16 (rows as sequences of their own) and 32 (rows per request in the
# prompt-chunk kernel: MQA, and the window)
@pytest.mark.parametrize("arch,overrides,by_request", [
    ("llama", {}, False), ("llama-mqa-bias", {}, True), ("mistral", {}, False), ("mistral", {"head_dim": 32}, True),
    ("phi3-partial-rotary", {}, False)])
def test_decode_stack_runs_speculative_verify_steps_at_hf_parity(arch, overrides, by_request, model_dir, hf_reference,
                                                                 tmp_path, monkeypatch):
    """A verify step (k + 1 query rows of one request) runs all layers in one C++ call, each
    row attending up to its own position: greedy tokens and logprobs meet the fp32 parity
    standard, at batch 1 (4 rows) and 2 (8 rows). Drafts from prompt lookup are mostly wrong
    on random weights, so rejected rows' K/V are overwritten later."""
    path = make_tiny_model(arch, tmp_path, **overrides) if overrides else model_dir(arch)
    reference = hf_greedy(path, PROMPTS[:4], NEW_TOKENS) if overrides else hf_reference(arch)[:4]
    llm = make_llm(path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    calls = _count_stack_calls(llm, monkeypatch)
    spec = llm.llm_engine.scheduler.spec_stats
    for batch in (1, 2):
        drafts, verify_calls = spec.num_drafts, calls[1]
        assert_matches_reference(reference, *greedy_in_batches(llm, PROMPTS[:4], batch))
        assert spec.num_drafts > drafts and calls[1] > verify_calls
        if batch == 1:  # every step with a draft went to the stack
            assert calls[1] - verify_calls >= spec.num_drafts - drafts
    assert llm.llm_engine.runner.model.model.fused_decoder.verify_by_request == by_request


@pytest.mark.parametrize("cache_bytes", [1, None])
def test_verify_steps_run_layer_by_layer_where_the_weights_outgrow_the_cache(cache_bytes, model_dir, hf_reference,
                                                                             monkeypatch):
    """Weights larger than the last-level cache (or a cache size the OS does not give) leave
    verify steps to oneDNN layer by layer; decode steps still take the stack. On AVX2 cores the
    GEMV reading the panels beats the packed GEMM from memory too: verify steps of up to 5 rows
    (4 here) still take the stack."""
    monkeypatch.setattr(decode_stack, "last_level_cache_bytes", lambda: cache_bytes)
    llm = make_llm(model_dir("llama"), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    calls = _count_stack_calls(llm, monkeypatch)
    assert_matches_reference(hf_reference("llama")[:4], *greedy_in_batches(llm, PROMPTS[:4], 1))
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert calls[0] > 0 and (calls[1] > 0 if PANELS else calls[1] == 0)
    assert llm.llm_engine.runner.model.model.fused_decoder.verify_rows == (5 if PANELS else 0)


@pytest.mark.parametrize("arch,engine_args,fused", [
    ("llama", {}, True),
    ("qwen2", {}, True),
    ("llama", PLAIN, False),  # no fused kernels at all
    ("llama", {"small_batch_gemv": False}, False),  # no plain weights for the GEMV kernel
    ("llama", {"enable_lora": True}, False),  # adapters add deltas to the projections
    ("qwen3", {}, False),  # q/k norms
    ("gemma", {}, False),  # Gemma's RMSNorm
    ("mixtral", {}, False),  # experts
])
def test_decode_stack_only_where_every_part_is_on_the_kernels(arch, engine_args, fused, model_dir):
    llm = make_llm(model_dir(arch), **engine_args)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
    decoder = llm.llm_engine.runner.model.model.fused_decoder
    assert (decoder is not None and decoder.stack is not None) == fused


def test_last_level_cache_is_the_highest_data_level(tmp_path, monkeypatch):
    """sysfs's cache entries: the instruction cache is skipped, sizes in K and M are read, the
    highest level wins, and a machine without the entries gives None."""
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "2048K"), (3, "Unified", "32M")]):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        for name, text in (("level", str(level)), ("type", kind), ("size", size)):
            (entry / name).write_text(text + "\n")
    monkeypatch.setattr(cache_size, "_CACHES", tmp_path)
    cache_size.last_level_cache_bytes.cache_clear()
    try:
        assert cache_size.last_level_cache_bytes() == 32 * 2**20
        monkeypatch.setattr(cache_size, "_CACHES", tmp_path / "absent")
        cache_size.last_level_cache_bytes.cache_clear()
        assert cache_size.last_level_cache_bytes() is None
    finally:
        cache_size.last_level_cache_bytes.cache_clear()

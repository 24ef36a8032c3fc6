"""bf16 end to end (weights, activations, KV cache) against the fp32 Hugging Face reference.

Tolerance, and why it is what it is: bf16 keeps 8 significant bits, so every
stored weight and activation carries a relative rounding error up to 2^-9
(0.2%). Through the layers these add up to logit (and logprob) errors of a
few hundredths on these models: measured worst cases 0.031-0.034 for
tokenmill and 0.033-0.041 for HF transformers' own bf16 run. So:

* a greedy token may differ from the fp32 reference's only at a step where the
  reference's top-2 logit margin is below ``TIE`` = 0.1 (a larger margin is
  not a rounding effect); the sequence is compared up to that step;
* agreeing steps' logprobs may differ by less than ``LOGPROB`` = 0.1.

Both bounds are 2.5x the worst error measured. HF's bf16 run is held to the
same bounds in the same test, so they measure what bf16 costs, not slack
granted to tokenmill.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import NEW_TOKENS, PLAIN, PROMPTS, greedy_in_batches, make_llm
from tokenmill import SamplingParams
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy

TIE = 0.1
LOGPROB = 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_bf16_engine_matches_fp32_reference_within_bf16_rounding(arch, model_dir, hf_reference):
    reference = hf_reference(arch)
    hf_bf16 = hf_greedy(model_dir(arch), PROMPTS, NEW_TOKENS, dtype=torch.bfloat16)
    assert_matches_reference(reference, [s.token_ids for s in hf_bf16], [s.logprobs for s in hf_bf16],
                             tie_tolerance=TIE, logprob_tolerance=LOGPROB)

    llm = make_llm(model_dir(arch), dtype="bfloat16")
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    assert_matches_reference(reference, tokens, logprobs, tie_tolerance=TIE, logprob_tolerance=LOGPROB)


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_takes_the_checkpoint_dtype_where_the_cpu_computes_it(native, tmp_path, monkeypatch):
    """A bf16 checkpoint runs in bf16 (KV cache included) without being asked to, on a CPU
    with bf16 arithmetic; elsewhere in fp32, which runs the same weights several times
    faster. (Both CPUs are played here by the one predicate the choice reads.)"""
    from tokenmill.core.config.model_config import load_model_config
    from tokenmill.plugins.platforms.cpu import platform
    from tokenmill.testing.tiny_models import make_tiny_model

    monkeypatch.setattr(platform, "native_bf16", lambda: native)
    path = make_tiny_model("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    expected = torch.bfloat16 if native else torch.float32
    resolve = platform.CpuPlatform(None).resolve_dtype
    assert load_model_config(path, resolve_dtype=resolve).dtype == expected
    assert load_model_config(path, "bfloat16", resolve_dtype=resolve).dtype == torch.bfloat16  # asked for
    assert load_model_config(path).dtype == torch.bfloat16  # without a platform: the stored dtype
    # plain PyTorch: the prepacked bf16 GEMMs the played CPU would get need the real one's instructions
    engine = make_llm(path, **PLAIN).llm_engine
    assert engine.model_config.dtype == expected
    caches = [m.kv_cache for m in engine.runner.model.modules() if hasattr(m, "kv_cache")]
    assert caches and all(c.dtype == expected for c in caches)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_native_bf16_means_the_bf16_instructions_not_just_avx512():
    """An AVX-512 core without AVX512-BF16 or AMX (Ice Lake, Skylake-X) runs oneDNN's bf16 GEMMs
    emulated, ~4x slower than fp32, though oneDNN calls bf16 supported there: dtype auto must
    then compute a bf16 checkpoint in fp32. The flags come from the kernel, not from torch."""
    from tokenmill.plugins.platforms.cpu.dtypes import native_bf16

    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    assert native_bf16() == bool(torch.backends.mkldnn.is_available() and flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied"])
def test_bf16_checkpoint_in_fp32_keeps_bf16_weights_and_matches_hf_fp32(arch, tmp_path):
    """A bf16 checkpoint computed in fp32: the weights the GEMV streams stay bf16 (their values
    are bf16, so widening them is exact), and on AVX2 cores (the packed GEMM's panels) the
    panels too, the only copy of each linear weight, the LM head's included; an untied
    embedding table stays bf16, a tied one fp32 (the logits are computed from it). The engine
    meets the fp32 parity standard against HF's fp32 run of the same checkpoint, at batch 1
    (the GEMV and the fused decode stack) and batched (the packed GEMMs)."""
    from tokenmill.core.layers.linear import Linear
    from tokenmill.plugins.platforms.cpu.kernels import cpu_kernels
    from tokenmill.plugins.platforms.cpu.prepacked_linear import PrepackedLinearMethod
    from tokenmill.testing.tiny_models import make_tiny_model

    path = make_tiny_model(arch, tmp_path / "bf16", dtype=torch.bfloat16)
    reference = hf_greedy(path, PROMPTS[:4], NEW_TOKENS, dtype=torch.float32)
    llm = make_llm(path, dtype="float32")
    model = llm.llm_engine.runner.model
    tied = arch.endswith("-tied")
    assert model.model.embed_tokens.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, PrepackedLinearMethod) for m in linears)
    assert all(m.method.gemv_weight(m).dtype == torch.bfloat16 for m in linears)
    kernels = cpu_kernels()
    if kernels is not None and kernels.packed_gemm_preferred():
        assert all(m.packed_weight.dtype == torch.bfloat16 for m in linears)
        assert all(not hasattr(m, "weight") and m.method.blocked is m.packed_weight for m in linears
                   if m is not getattr(model, "lm_head", None) or not tied)
    for batch in (1, 4):
        tokens, logprobs = greedy_in_batches(llm, PROMPTS[:4], batch)
        assert_matches_reference(reference, tokens, logprobs)


def test_an_embedding_table_updated_in_place_or_not_bf16_stays_fp32(tmp_path):
    """Weight transfer (and sleep mode) write new values into the table, which need not be
    bf16; an fp32 checkpoint's values are not bf16."""
    from tokenmill.testing.tiny_models import make_tiny_model

    bf16 = make_tiny_model("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    updated = make_llm(bf16, dtype="float32", enable_sleep_mode=True).llm_engine.runner.model
    assert updated.model.embed_tokens.weight.dtype == torch.float32
    fp32 = make_tiny_model("llama", tmp_path / "fp32")
    assert make_llm(fp32).llm_engine.runner.model.model.embed_tokens.weight.dtype == torch.float32


def test_fp32_weights_that_are_not_bf16_stay_fp32(model_dir):
    """The weights the GEMV streams (the plain ones, or oneDNN's packed copy read in place)."""
    from tokenmill.core.layers.linear import Linear
    from tokenmill.plugins.platforms.cpu.prepacked_linear import PrepackedLinearMethod

    llm = make_llm(model_dir("llama"))
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all((m.method.gemv_weight(m) if isinstance(m.method, PrepackedLinearMethod) else m.weight)
                           .dtype == torch.float32 for m in linears)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_kv_cache_under_fp32_matches_fp32_reference_within_bf16_rounding(arch, model_dir, hf_reference):
    """``kv_cache_dtype="bfloat16"`` on an fp32 model rounds only the stored K/V (relative
    error up to 2^-9), a subset of what a bf16 run rounds, so it is held to the same TIE and
    LOGPROB bounds (measured worst logprob error 0.006-0.009 on llama, qwen3 and mistral).
    Batches of 1 (the fused decode stack) and 4 (the batched kernels)."""
    from tokenmill.plugins.platforms.cpu.decode_stack import DecodeStack

    reference = hf_reference(arch)
    llm = make_llm(model_dir(arch), kv_cache_dtype="bfloat16")
    engine = llm.llm_engine
    assert engine.model_config.dtype == torch.float32
    caches = [m.kv_cache for m in engine.runner.model.modules() if hasattr(m, "kv_cache")]
    assert caches and all(c.dtype == torch.bfloat16 for c in caches)
    for batch in (1, 4):
        tokens, logprobs = greedy_in_batches(llm, PROMPTS, batch)
        assert_matches_reference(reference, tokens, logprobs, tie_tolerance=TIE, logprob_tolerance=LOGPROB)
    if arch == "llama":
        decoder = engine.runner.model.model.fused_decoder
        assert isinstance(decoder, DecodeStack) and decoder.stack is not None, "batch 1 took the fused stack"

"""Quantized checkpoints (GPTQ, AWQ, FP8) load exactly: logits equal the shared references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import QUANT_CHECKPOINTS, make_llm
from tokenmill import LLM, SamplingParams, load_config
from tokenmill.interfaces.errors import ConfigError
from tokenmill.plugins.quantization.group_quant import GroupQuantizedLinear
from tokenmill.plugins.quantization.packing import awq_to_gptq, pack, pack_awq, unpack, unpack_awq
from tokenmill.testing.logits import prompt_logits

CHECKPOINTS = QUANT_CHECKPOINTS
NAMES = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "reference.safetensors").is_file()) \
    if CHECKPOINTS.is_dir() else []
needs_checkpoints = pytest.mark.skipif(not NAMES, reason=f"shared checkpoints not found at {CHECKPOINTS}")


def logits_of(path: Path, quantize_activations: bool = True, **engine_args) -> tuple[torch.Tensor, dict]:
    reference = load_file(path / "reference.safetensors")
    config = load_config(model=str(path), dtype="float32", kv_cache_memory_bytes=2**24, **engine_args)
    config.quantization.quantize_activations = quantize_activations
    engine = LLM(config=config).llm_engine
    logits = torch.stack([prompt_logits(engine, row.tolist()) for row in reference["input_ids"]])
    return logits, reference


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


@needs_checkpoints
@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_logits_match_exact_dequantization(name):
    """Every shared checkpoint reproduces logits_ref (weights dequantized exactly) in fp32."""
    logits, reference = logits_of(CHECKPOINTS / name, quantize_activations=False)
    assert relative_error(logits, reference["logits_ref"]) < 1e-3


@needs_checkpoints
@pytest.mark.parametrize("name", [n for n in NAMES if "fp8" in n])
def test_fp8_activation_quantization_matches_w8a8_reference(name):
    """With the scheme's activation quantization on, FP8 checkpoints reproduce logits_w8a8."""
    logits, reference = logits_of(CHECKPOINTS / name)
    assert relative_error(logits, reference["logits_w8a8"]) < 1e-3
    assert relative_error(logits, reference["logits_ref"]) > 1e-3  # activations really were quantized


@needs_checkpoints
@pytest.mark.parametrize("name", NAMES)
def test_quantized_checkpoints_generate_end_to_end(name):
    """Greedy generation runs through LLM.generate on quantized weights and stays quantized in memory."""
    llm = make_llm(CHECKPOINTS / name, dtype="float32")
    [output] = llm.generate({"prompt_token_ids": [5, 9, 33, 71, 2]}, SamplingParams(temperature=0, max_tokens=8,
                            ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
    if name.startswith(("gptq-w4", "awq")):  # 4-bit weights stay packed: no full-precision copy
        assert not hasattr(layer, "weight") and layer.int4_weight.dtype == torch.uint8
    elif name.startswith("gptq-w8"):
        assert not hasattr(layer, "weight") and layer.q_weight.dtype == torch.uint8


@needs_checkpoints
def test_unsupported_variants_fail_naming_the_field(tmp_path):
    """3-bit GPTQ and an unknown checkpoint_format fail at load with the field's name."""
    for field, value, key in (("bits", 3, "bits"), ("checkpoint_format", "marlin", "checkpoint_format")):
        target = tmp_path / f"bad-{field}"
        shutil.copytree(CHECKPOINTS / "gptq-w4g64-sym-v1-rtn", target)
        (target / "quantize_config.json").unlink()
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"][field] = value
        (target / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=key):
            make_llm(target)


@needs_checkpoints
def test_modules_to_not_convert_stay_unquantized(tmp_path):
    """A layer listed in modules_to_not_convert loads as plain weights (here: from a dense copy)."""
    source = CHECKPOINTS / "awq-w4g64-gemm-rtn"
    target = tmp_path / "partial-awq"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(target / "model.safetensors")
    dense = load_file(CHECKPOINTS / "base-fp16" / "model.safetensors")
    for name in [n for n in tensors if ".down_proj." in n]:
        del tensors[name]
    for name in [n for n in dense if ".down_proj." in n]:
        tensors[name] = dense[name]
    from safetensors.torch import save_file
    save_file(tensors, target / "model.safetensors")
    llm = make_llm(target, dtype="float32")
    model = llm.llm_engine.runner.model
    down = model.model.layers[0].mlp.down_proj
    weight = down.packed_weight if hasattr(down, "packed_weight") else down.weight  # prepacked unless eager
    assert weight.dtype == torch.float32 and not hasattr(down, "int4_weight")
    assert hasattr(model.model.layers[0].mlp.gate_up_proj, "int4_weight")


@needs_checkpoints
def test_online_fp8_quantizes_an_unquantized_checkpoint():
    """quantization='fp8' on a full-precision checkpoint quantizes weights per channel at load."""
    base = CHECKPOINTS / "base-fp16"
    exact, reference = logits_of(base)
    online, _ = logits_of(base, quantization="fp8")
    assert relative_error(exact, reference["logits_ref"]) < 1e-3
    assert 1e-4 < relative_error(online, reference["logits_ref"]) < 0.1


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.sampled_from([8, 16, 32]), cols=st.sampled_from([8, 16]),
       seed=st.integers(0, 1000))
def test_gptq_pack_unpack_round_trip(bits, rows, cols, seed):
    """Packing along either dimension and unpacking gives the values back."""
    values = torch.randint(0, 2**bits, (rows, cols), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack(pack(values, bits, dim=0), bits, dim=0), values.to(torch.int32))
    assert torch.equal(unpack(pack(values, bits, dim=1), bits, dim=1), values.to(torch.int32))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000))
def test_awq_nibble_order_round_trip(seed):
    """AWQ's interleaved nibble order packs and unpacks to the same matrix."""
    values = torch.randint(0, 16, (16, 32), generator=torch.Generator().manual_seed(seed))
    packed = pack_awq(values)
    assert packed.shape == (16, 4)
    assert torch.equal(unpack_awq(packed), values.to(torch.int32))
    # nibble 1 of word 0 holds column 2 (order 0, 2, 4, 6, 1, 3, 5, 7)
    assert ((packed[0, 0] >> 4) & 0xF).item() == values[0, 2].item()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), rows=st.sampled_from([8, 16, 64]), words=st.integers(1, 6))
def test_awq_repacks_word_by_word_to_gptqs_layout(seed, rows, words):
    """The GPU path's AWQ repack (nibbles moved word by word) gives GPTQ's packing of the same
    values, the sign bit included (a 15 in the eighth row of a word)."""
    values = torch.randint(0, 16, (rows, 8 * words), generator=torch.Generator().manual_seed(seed))
    values[7] = 15
    assert torch.equal(awq_to_gptq(pack_awq(values)), pack(values, 4, dim=0))


def random_group_quantized(seed: int, k: int, n: int, group: int, bits: int, act_order: bool):
    """(q [K, N], zeros, scales [G, N], g_idx [K], dequantized W [K, N], a generator for inputs)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=g)
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=g)
    scales = torch.rand(k // group, n, generator=g) * 0.05 + 0.01
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return q, zeros, scales, g_idx, (q.float() - zeros[g_idx].float()) * scales[g_idx], g


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), act_order=st.booleans(), bits=st.sampled_from([4, 8]))
def test_group_quantized_kernels_equal_dequantization(seed, act_order, bits):
    """The CPU int4 kernel (with act-order permutation) and the int8 path equal x @ dequant(W)."""
    k = 128
    q, zeros, scales, g_idx, w, g = random_group_quantized(seed, k, 32, 32, bits, act_order)
    x = torch.randn(5, k, generator=g)
    layer = torch.nn.Module()
    kernel = GroupQuantizedLinear(q, zeros, scales, g_idx, bits, torch.float32, layer)
    assert kernel.kind == ("int4pack" if bits == 4 else "dequant")
    torch.testing.assert_close(kernel.apply(layer, x, None), x @ w, atol=1e-4, rtol=1e-4)


@needs_checkpoints
@pytest.mark.parametrize("name", NAMES)
def test_quantized_checkpoint_serves_over_http(name):
    """Every shared checkpoint answers /v1/completions through the real server, greedily
    with the same tokens as the offline engine."""
    import httpx

    from server_harness import running_server

    llm = make_llm(CHECKPOINTS / name, dtype="float32")
    prompt = [5, 9, 33, 71]
    offline = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                        logprobs=0), use_tqdm=False)[0]
    with running_server(llm.llm_engine, served_model_name=["q"]) as (url, _):
        response = httpx.post(url + "/v1/completions", json={"model": "q", "prompt": prompt, "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True, "logprobs": 0},
                              timeout=60)
    assert response.status_code == 200
    served = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert served == pytest.approx([e[t].logprob for e, t in zip(offline.outputs[0].logprobs,
                                                                  offline.outputs[0].token_ids)])


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), bits=st.sampled_from([4, 8]), act_order=st.booleans(),
       m=st.sampled_from([1, 5, 17]))
def test_triton_dequant_gemm_matches_the_torch_path(seed, bits, act_order, m):
    """The GPU kernel (interpreted here) equals the torch dequantization, act-order included.
    AWQ checkpoints reach it in the same canonical form (see the AWQ round-trip test)."""
    triton_gemm = pytest.importorskip("tokenmill.plugins.quantization.triton_gemm")
    k = 64
    q, zeros, scales, g_idx, w, g = random_group_quantized(seed, k, 48, 16, bits, act_order)
    qweight = pack(q, bits, dim=0)
    x = torch.randn(m, k, generator=g)
    expected = x @ w
    got = triton_gemm.dequant_gemm(x, qweight, zeros.to(torch.int32), scales, g_idx.to(torch.int32), bits)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def weight_only_and_dense_logits(quantized: Path, dense: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt logits of the quantized checkpoint (weights only, activations unquantized) and of
    the dense model holding its dequantized weights."""
    prompt = list(range(6, 60))
    config = load_config(model=str(quantized), kv_cache_memory_bytes=2**24)
    config.quantization.quantize_activations = False
    return prompt_logits(LLM(config=config).llm_engine, prompt), prompt_logits(make_llm(dense).llm_engine, prompt)


@pytest.mark.parametrize("method,bits", [("gptq", 4), ("gptq", 8), ("awq", 4), ("fp8", 8)])
def test_own_quantizer_round_trips_through_the_loader(method, bits, model_dir, tmp_path):
    """tokenmill.testing's quantizer writes the real layouts: the loaded quantized model equals
    a dense model holding the dequantized weights (weight-only, exact dequantization)."""
    from tokenmill.testing.quantize import quantize_model

    quantized = quantize_model(model_dir("llama"), tmp_path / "q", method, bits=bits, group_size=32,
                               dense_copy=tmp_path / "dense")
    got, expected = weight_only_and_dense_logits(quantized, tmp_path / "dense")
    assert relative_error(got, expected) < 1e-4


@pytest.mark.parametrize("arch,sizes", [
    ("llama", dict(hidden_size=192, intermediate_size=320)),  # parts of 192, 96 and 320 rows; K 192 and 320
    ("phi3", dict(hidden_size=192, intermediate_size=320)),  # qkv_proj and gate_up_proj fused on disk
    # fused on disk, gate_up's blocks straddle gate and up with as many block rows as per-part blocks
    ("phi3", dict(hidden_size=128, intermediate_size=100, num_key_value_heads=4)),
], ids=["llama-192-320", "phi3-192-320", "phi3-128-100"])
def test_block_fp8_with_partial_blocks_equals_the_dequantized_weights(arch, sizes, tmp_path):
    """128x128 blocks over dims that are not multiples of 128, in N and K: the last block of
    each row and column is partial. Logits equal a dense model holding fp8 * scale expanded
    per block (weight-only, fp32)."""
    from tokenmill.testing.quantize import quantize_model
    from tokenmill.testing.tiny_models import make_tiny_model

    base = make_tiny_model(arch, tmp_path / "base", **sizes)
    quantized = quantize_model(base, tmp_path / "q", "fp8", weight_block_size=(128, 128),
                               dense_copy=tmp_path / "dense")
    got, expected = weight_only_and_dense_logits(quantized, tmp_path / "dense")
    assert relative_error(got, expected) < 1e-5
    assert (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max().item() < 1e-4



def transformers_fp8_reference(quantized: Path, dense: Path, prompt: list[int],
                               quantize_activations: bool) -> torch.Tensor:
    """Prompt logits of transformers running the block-FP8 checkpoint as its ``FP8Linear``
    does: each weight widened by ``_dequantize_fp8_weight`` with the config's
    ``weight_block_size``, activations rounded through FP8 per token when asked. (Its
    load-time dequantizer, the CPU default, takes the block from the scale grid instead:
    192 rows over 2 scale rows read as 96-row blocks, not DeepSeek's 128 and a partial 64.)"""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = json.loads((quantized / "config.json").read_text())
    block = config["quantization_config"]["weight_block_size"]
    tensors = load_file(quantized / "model.safetensors")
    widened = {name: (_dequantize_fp8_weight(w, tensors[name + "_scale_inv"], block, torch.float32)
                      if w.dtype == torch.float8_e4m3fn else w)
               for name, w in tensors.items() if not name.endswith("_scale_inv")}
    shutil.copytree(quantized, dense)
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))
    save_file(widened, dense / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    if quantize_activations:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.register_forward_pre_hook(lambda _, args: (fake_quantize_per_token(args[0]),))
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("arch", ["llama", "phi3"], ids=["load-fused", "checkpoint-fused"])
def test_block_fp8_with_a_192_hidden_size_matches_transformers(arch, quantize_activations, tmp_path):
    """A block-FP8 model whose K and N are no multiples of 128: hidden 192 (3 heads of 64, one
    KV head: q and down have a block and a half of rows, k and v half a block, every K a
    partial block), intermediate 512. Its prompt logprobs equal transformers' FP8Linear
    arithmetic within fp32 rounding, weight-only and with per-token activation rounding, for
    a family fused at load (Llama's q/k/v) and one fused on disk (Phi-3's qkv_proj). With
    activations rounded, an input within an fp32 ulp of an e4m3 midpoint may round either
    way (a step of 1/16 of itself), so W8A8 is held to the shared checkpoints' bound, 1e-3
    relative in the logits, and the same greedy tokens."""
    from tokenmill.testing.quantize import quantize_model
    from tokenmill.testing.tiny_models import make_tiny_model

    base = make_tiny_model(arch, tmp_path / "base", hidden_size=192, intermediate_size=512,
                           num_attention_heads=3, num_key_value_heads=1)
    quantized = quantize_model(base, tmp_path / "q", "fp8", weight_block_size=(128, 128))
    prompt = list(range(6, 60))
    config = load_config(model=str(quantized), dtype="float32", kv_cache_memory_bytes=2**24)
    config.quantization.quantize_activations = quantize_activations
    got = prompt_logits(LLM(config=config).llm_engine, prompt).log_softmax(-1)
    expected = transformers_fp8_reference(quantized, tmp_path / "dense", prompt,
                                          quantize_activations).log_softmax(-1)
    if quantize_activations:
        assert relative_error(got, expected) < 1e-3
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    else:
        assert (got - expected).abs().max().item() < 1e-4

@needs_checkpoints
@pytest.mark.parametrize("name", [n for n in NAMES if "fp8" in n and "block" not in n])
def test_fp8_scaled_mm_keeps_e4m3_weights_and_matches_the_w8a8_reference(name):
    """fp8_kernel: scaled_mm (a GPU's default) multiplies FP8 by FP8 with torch._scaled_mm on
    the e4m3 weights: the same W8A8 logits as the dequantizing kernel, a quarter of the fp32
    weight bytes in the linear layers."""
    path = CHECKPOINTS / name
    reference = load_file(path / "reference.safetensors")
    engines = {}
    for kernel in ("scaled_mm", "dequantize"):
        config = load_config(model=str(path), dtype="float32", kv_cache_memory_bytes=2**24)
        config.quantization.fp8_kernel = kernel
        engines[kernel] = LLM(config=config).llm_engine
    logits = {kernel: torch.stack([prompt_logits(engine, row.tolist()) for row in reference["input_ids"]])
              for kernel, engine in engines.items()}
    assert relative_error(logits["scaled_mm"], reference["logits_w8a8"]) < 1e-3
    assert relative_error(logits["scaled_mm"], logits["dequantize"]) < 1e-5
    layers = [engine.runner.model.model.layers[0].mlp.down_proj for engine in engines.values()]
    assert layers[0].weight.dtype == torch.float8_e4m3fn and layers[1].weight.dtype == torch.float32
    assert layers[0].weight.nbytes * 4 == layers[1].weight.nbytes


@pytest.mark.parametrize("intermediate, fp8_weights", [(128, True), (136, False)])
def test_fp8_on_the_gpu_multiplies_in_fp8_only_sizes_cudas_scaled_mm_takes(intermediate, fp8_weights, tmp_path):
    """CUDA's ``torch._scaled_mm`` takes K and N in multiples of 16 (the CPU's takes any): on the
    CUDA stand-in, "auto" keeps the down projection's e4m3 weights for it at an intermediate
    size of 128 and dequantizes them at 136 (K = 136), which an explicit ``scaled_mm`` refuses."""
    from tokenmill.testing.fake_cuda import fake_cuda
    from tokenmill.testing.fake_cuda_platform import FakeCudaPlatform
    from tokenmill.testing.quantize import quantize_model
    from tokenmill.testing.tiny_models import make_tiny_model
    from conftest import with_platforms

    base = make_tiny_model("llama", tmp_path / "base", hidden_size=64, intermediate_size=intermediate,
                           num_attention_heads=4, num_key_value_heads=1)
    quantized = quantize_model(base, tmp_path / "q", "fp8")
    args = dict(model=str(quantized), device="fake-cuda", dtype="bfloat16", enforce_eager=True,
                kv_cache_memory_bytes=2**23, max_num_seqs=2, max_num_batched_tokens=32)
    with fake_cuda():
        llm = LLM(config=load_config(**args), plugin_manager=with_platforms(FakeCudaPlatform))
        down = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
        assert (down.weight.dtype == torch.float8_e4m3fn) == fp8_weights
        output = llm.generate([{"prompt_token_ids": list(range(3, 12))}], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(output[0].outputs[0].token_ids) == 3
    config = load_config(model=str(quantized), dtype="float32", kv_cache_memory_bytes=2**24)
    config.quantization.fp8_kernel = "scaled_mm"
    if fp8_weights:
        LLM(config=config)
    else:
        with pytest.raises(ConfigError, match="multiples of 16"):
            LLM(config=config)

"""LoRA adapters: many per batch, equal to HF with the adapter merged into the weights."""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS, PROMPTS, make_llm
from tokenmill import LoRARequest, SamplingParams
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy
from tokenmill.testing.tiny_adapters import make_lora_adapter, merge_lora

ADAPTERS = {
    "qv-r4": dict(rank=4, targets=["q_proj", "v_proj"]),
    "attn-mlp-r8": dict(rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-r16-rslora": dict(rank=16, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True, alpha=8),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> (adapter dir, merged model dir) for the tiny Llama."""
    base = model_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        adapter = make_lora_adapter(base, root / name, seed=i, **spec)
        made[name] = (adapter, merge_lora(base, adapter, root / f"{name}-merged"))
    return made


def lora_llm(model_dir, **engine_args):
    return make_llm(model_dir("llama"), enable_lora=True, max_loras=3, max_lora_rank=16, **engine_args)


def tokens_and_logprobs(outputs):
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs


def test_three_adapters_and_base_in_one_batch_match_merged_hf(model_dir, adapters):
    """Each prompt decodes as HF does with its own adapter merged (or none), all batched together."""
    names = [None, *ADAPTERS]
    assigned = [names[i % len(names)] for i in range(len(PROMPTS))]
    requests = [None if n is None else LoRARequest(n, i + 1, str(adapters[n][0])) for i, n in enumerate(assigned)]
    llm = lora_llm(model_dir)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=requests)
    tokens, logprobs = tokens_and_logprobs(outputs)
    for name in names:
        rows = [i for i, n in enumerate(assigned) if n == name]
        reference_model = model_dir("llama") if name is None else adapters[name][1]
        reference = hf_greedy(reference_model, [PROMPTS[i] for i in rows], NEW_TOKENS)
        assert_matches_reference(reference, [tokens[i] for i in rows], [logprobs[i] for i in rows])
    # the adapters really change the outputs
    assert len({tuple(tokens[i]) for i in range(4)}) > 1


def test_prefix_cache_keeps_adapters_apart(model_dir, adapters):
    """The same prompt under two adapters, prefix caching on, gives each adapter's own output."""
    llm = lora_llm(model_dir, block_size=8)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    first = LoRARequest("qv-r4", 1, str(adapters["qv-r4"][0]))
    second = LoRARequest("attn-mlp-r8", 2, str(adapters["attn-mlp-r8"][0]))
    a1 = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=first)[0]
    b1 = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=second)[0]
    a2 = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=first)[0]
    assert b1.num_cached_tokens == 0  # another adapter: no KV reuse
    assert a2.num_cached_tokens > 0
    assert a1.outputs[0].token_ids == a2.outputs[0].token_ids != b1.outputs[0].token_ids
    for output, name in ((a1, "qv-r4"), (b1, "attn-mlp-r8")):
        [reference] = hf_greedy(adapters[name][1], [PROMPTS[0]], NEW_TOKENS)
        assert_matches_reference([reference], *tokens_and_logprobs([output]))


def test_max_loras_limits_adapters_per_step(model_dir, adapters):
    """With max_loras=1, two adapters never share a step, and both still finish correctly."""
    llm = make_llm(model_dir("llama"), enable_lora=True, max_loras=1, max_lora_rank=16)
    engine = llm.llm_engine
    seen = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        seen.append({engine.scheduler.requests[s.request_id].adapter_name for s in batch.scheduled
                     if s.request_id in engine.scheduler.requests} - {None})
        return batch

    engine.scheduler.schedule = recording
    requests = [LoRARequest(n, i + 1, str(adapters[n][0])) for i, n in enumerate(["qv-r4", "attn-mlp-r8"])]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False,
                           lora_request=requests)
    assert all(len(names) <= 1 for names in seen)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)


def test_unsupported_adapters_fail_at_load_with_a_list(model_dir, adapters, tmp_path):
    """DoRA, modules_to_save, bias and too-large ranks are refused when loading, all listed."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(adapters["qv-r4"][0], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config.update(use_dora=True, modules_to_save=["lm_head"], bias="all")
    (bad / "adapter_config.json").write_text(json.dumps(config))
    llm = lora_llm(model_dir)
    with pytest.raises(InvalidRequest) as info:
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(bad)))
    message = str(info.value)
    assert "use_dora" in message and "modules_to_save" in message and "bias" in message
    big = make_lora_adapter(model_dir("llama"), tmp_path / "big", rank=32, targets=["q_proj"])
    with pytest.raises(InvalidRequest, match="max_lora_rank"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=LoRARequest("big", 10, str(big)))


def test_adapter_tensors_that_do_not_fit_fail_at_load_with_a_list(model_dir, adapters, tmp_path):
    """A lora_A without its lora_B, a stray tensor, and an A sized for another base model are
    refused when loading, all listed (the first used to be a KeyError, the last a failed step)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(adapters["qv-r4"][0], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers"
    del tensors[f"{prefix}.0.self_attn.q_proj.lora_B.weight"]
    tensors[f"{prefix}.0.self_attn.v_proj.extra.weight"] = torch.zeros(2)
    tensors[f"{prefix}.1.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 128)
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(InvalidRequest) as info:
        lora_llm(model_dir).generate("x", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(bad)))
    message = str(info.value)
    assert "model.layers.0.self_attn.q_proj has lora_A but no lora_B" in message
    assert f"{prefix}.0.self_attn.v_proj.extra.weight" in message
    assert "model.layers.1.self_attn.q_proj: lora_A (4, 128)" in message


def test_lora_request_needs_enable_lora(model_dir, adapters):
    """Without enable_lora a LoRARequest is a clear error, not a silent base-model answer."""
    with pytest.raises(InvalidRequest, match="enable_lora"):
        make_llm(model_dir("llama")).generate("x", GREEDY, use_tqdm=False,
                                              lora_request=LoRARequest("qv-r4", 1, str(adapters["qv-r4"][0])))


def test_triton_bgmv_kernel_matches_the_torch_path():
    """The GPU LoRA kernel (interpreted here) adds each token's own adapter delta; -1 tokens are untouched."""
    import torch

    triton_lora = pytest.importorskip("tokenmill.plugins.adapters.triton_lora")
    g = torch.Generator().manual_seed(0)
    slots_count, tokens, k, rank, n = 3, 7, 40, 8, 24
    a = torch.randn(slots_count, rank, k, generator=g)
    b = torch.randn(slots_count, n, rank, generator=g)
    x = torch.randn(tokens, k, generator=g)
    slots = torch.tensor([0, 2, -1, 1, 2, -1, 0], dtype=torch.int32)
    base = torch.randn(tokens, n, generator=g)
    y = base.clone()
    triton_lora.lora_delta(x, a, b, slots, y)
    expected = base.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[t] += (x[t] @ a[slot].T) @ b[slot].T
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)

"""End-to-end engine behaviour through the offline API: stops, n, seeds, logprobs, aborts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import PROMPTS, make_llm
from tokenmill import SamplingParams
from tokenmill.interfaces.errors import InvalidRequest

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ids(prompt):
    return {"prompt_token_ids": prompt}


def test_greedy_output_does_not_depend_on_the_batch(llama):
    """A greedy request decodes the same alone and among eleven others."""
    params = SamplingParams(max_tokens=20, **GREEDY)
    alone = [llama.generate(ids(p), params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    together = llama.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together[:4]] == alone


def test_seeded_sampling_is_reproducible_and_seeds_differ(llama):
    """Same seed, same text whatever the batch; another seed, another text."""
    def sample(seed, batch):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        others = [ids(p) for p in PROMPTS[1:batch]]
        return llama.generate([ids(PROMPTS[0])] + others, params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(11, 1) == sample(11, 6)
    assert sample(11, 1) != sample(12, 1)


def test_n_returns_distinct_indexed_sequences(llama):
    """n=3 gives three sequences indexed 0..2, sampled independently."""
    [output] = llama.generate(ids(PROMPTS[2]), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12,
                                                              ignore_eos=True), use_tqdm=False)
    assert [o.index for o in output.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in output.outputs}) == 3
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in output.outputs)


def test_stop_strings_cut_text_and_report_the_reason(llama):
    """A stop string ends generation; the text stops before it unless asked to include it."""
    params = SamplingParams(max_tokens=30, **GREEDY)
    full = llama.generate(ids(PROMPTS[3]), params, use_tqdm=False)[0].outputs[0].text
    stop = full[10:13]
    assert stop and full.find(stop) == 10, "need a stop string that first occurs at 10"
    cut = llama.generate(ids(PROMPTS[3]), SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
                         use_tqdm=False)[0].outputs[0]
    assert cut.text == full[:10]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = llama.generate(ids(PROMPTS[3]), SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True,
                                                          **GREEDY), use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:13]


def test_stop_token_ids_and_min_tokens(llama):
    """A stop token ends the sequence (and is kept); min_tokens defers it."""
    base = llama.generate(ids(PROMPTS[4]), SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0]
    target = base.token_ids[5]
    first = base.token_ids.index(target)
    stopped = llama.generate(ids(PROMPTS[4]), SamplingParams(max_tokens=20, stop_token_ids=[target], **GREEDY),
                             use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == base.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)
    deferred = llama.generate(ids(PROMPTS[4]), SamplingParams(max_tokens=20, stop_token_ids=[target],
                                                              min_tokens=first + 2, **GREEDY),
                              use_tqdm=False)[0].outputs[0]
    assert len(deferred.token_ids) >= first + 2


def test_eos_stops_unless_ignored(model_dir, tmp_path):
    """The model's EOS (from generation_config) ends generation; ignore_eos overrides it."""
    source = model_dir("llama")
    base = make_llm(source).generate(ids(PROMPTS[5]), SamplingParams(max_tokens=12, **GREEDY),
                                     use_tqdm=False)[0].outputs[0].token_ids
    eos = base[3]
    target = tmp_path / "eos-model"
    shutil.copytree(source, target)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((target / name).read_text())
        data["eos_token_id"] = eos
        (target / name).write_text(json.dumps(data))
    llm = make_llm(target)
    stopped = llm.generate(ids(PROMPTS[5]), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == base[: base.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    ignored = llm.generate(ids(PROMPTS[5]), SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == base


def test_top_logprobs_and_prompt_logprobs_match_hf(model_dir):
    """logprobs=5 and prompt_logprobs=3 equal HF's log-softmax, across prefill chunks."""
    path = model_dir("llama")
    llm = make_llm(path, max_num_batched_tokens=16)
    prompt = PROMPTS[1]
    [output] = llm.generate(ids(prompt), SamplingParams(max_tokens=4, logprobs=5, prompt_logprobs=3, **GREEDY),
                            use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        full = torch.tensor([prompt + output.outputs[0].token_ids])
        reference = hf(full).logits[0].log_softmax(-1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert abs(entry[token].logprob - reference[position - 1, token].item()) < 1e-4
        top = reference[position - 1].topk(3).indices.tolist()
        assert all(t in entry for t in top)
    for step, entry in enumerate(output.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        top = row.topk(5)
        assert [entry[t].rank for t in top.indices.tolist()] == [1, 2, 3, 4, 5]
        assert all(isinstance(e.decoded_token, str) for e in entry.values())
    expected_cumulative = sum(e[t].logprob for e, t in zip(output.outputs[0].logprobs, output.outputs[0].token_ids))
    assert output.outputs[0].cumulative_logprob == pytest.approx(expected_cumulative)


def test_prompt_logprobs_survive_preemption(model_dir):
    """A request preempted mid-generation reports each prompt logprob exactly once."""
    llm = make_llm(model_dir("llama"), num_gpu_blocks_override=24, block_size=8, max_model_len=192)
    params = SamplingParams(max_tokens=24, prompt_logprobs=1, **GREEDY)
    outputs = llm.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for output, prompt in zip(outputs, PROMPTS):
        assert len(output.prompt_logprobs) == len(prompt)


def test_abort_frees_blocks_and_reports_abort(llama):
    """An aborted request finishes with 'abort' and gives back its KV blocks at once."""
    engine = llama.llm_engine
    pool = engine.scheduler.kv_cache.pool
    free_before = pool.num_free_blocks
    engine.add_request("to-abort", ids(PROMPTS[0]), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert pool.num_free_blocks < free_before
    [output] = engine.abort_request("to-abort")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert pool.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()


def test_a_request_id_can_be_reused_once_its_request_finished(llama):
    """The id of a finished request is free at once: the same id decodes the same tokens again
    (the runner drops the finished request's state before it adds the new one)."""
    engine = llama.llm_engine
    params = SamplingParams(max_tokens=5, **GREEDY)
    runs = []
    for _ in range(2):
        engine.add_request("reused", ids(PROMPTS[1]), params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(o for o in engine.step() if o.finished)
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert len(runs[0][0]) == 5 and runs[0] == runs[1]


def test_prompt_forms_and_output_fields(llama):
    """Strings, token-id dicts and token lists are all prompts; outputs keep the input order."""
    params = SamplingParams(max_tokens=3, **GREEDY)
    text = llama.generate("The quick brown fox", params, use_tqdm=False)
    assert text[0].prompt == "The quick brown fox"
    assert text[0].prompt_token_ids == llama.get_tokenizer().encode("The quick brown fox")
    mixed = llama.generate(["The quick", ids(PROMPTS[0]), {"prompt": "brown fox"}], params, use_tqdm=False)
    assert [o.prompt for o in mixed] == ["The quick", None, "brown fox"]
    as_list = llama.generate(PROMPTS[0], params, use_tqdm=False)
    assert as_list[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    completion = mixed[0].outputs[0]
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.text == llama.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    assert mixed[0].finished and completion.cumulative_logprob is None


def test_chat_uses_the_chat_template(llama):
    """LLM.chat formats messages with the model's template before generating."""
    messages = [{"role": "user", "content": "Hello there"}]
    [output] = llama.chat(messages, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    tokenizer = llama.get_tokenizer()
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    assert output.prompt_token_ids == expected
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("prompt,param", [
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids"),
    ({"prompt_token_ids": [7] * 600}, "prompt"),
    ({"nothing": 1}, "prompt"),
])
def test_invalid_prompts_are_rejected_with_the_parameter(llama, prompt, param):
    """Bad prompts fail in add_request with a typed error naming the field, before any step."""
    with pytest.raises(InvalidRequest) as info:
        llama.generate(prompt, SamplingParams(), use_tqdm=False)
    assert info.value.param == param
    assert not llama.llm_engine.has_unfinished_requests()


def test_temperature_with_top_k_one_equals_greedy(llama):
    """Sampling restricted to the single best token is greedy decoding."""
    greedy = llama.generate(ids(PROMPTS[6]), SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    topk = llama.generate(ids(PROMPTS[6]), SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)
    assert topk[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids

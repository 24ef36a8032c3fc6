"""vLLM's request parameters through the offline ``LLM`` API, with vLLM's names: the
SamplingParams fields, a prompt's ``cache_salt`` and ``LLM.chat``'s template options.
(The server's side of each is in test_request_fields.py.)"""

from __future__ import annotations

import pytest

from conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.core.sample.logits_processors.bad_words import bad_word_token_ids
from tokenmill.interfaces.errors import InvalidRequest

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir("llama"))


def test_truncate_prompt_tokens_cuts_the_chosen_side(llm):
    full = llm.get_tokenizer().encode(PROMPT)
    [left, right] = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=2, truncate_prompt_tokens=4, **GREEDY),
        SamplingParams(max_tokens=2, truncate_prompt_tokens=4, truncation_side="right", **GREEDY)], use_tqdm=False)
    assert left.prompt_token_ids == full[-4:] and right.prompt_token_ids == full[:4]
    [alone] = llm.generate({"prompt_token_ids": full[-4:]}, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert left.outputs[0].token_ids == alone.outputs[0].token_ids
    context = llm.llm_engine.max_model_len
    [fitted] = llm.generate({"prompt_token_ids": [7] * (context + 50)},
                            SamplingParams(max_tokens=3, truncate_prompt_tokens=-1, **GREEDY), use_tqdm=False)
    assert len(fitted.prompt_token_ids) == context - 3 and len(fitted.outputs[0].token_ids) == 3
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(truncate_prompt_tokens=0)
    assert info.value.param == "truncate_prompt_tokens"


def test_cache_salt_separates_prefix_cache_tenants(llm):
    prompt = {"prompt": " ".join(["An offline salted prompt"] * 8)}
    params = SamplingParams(max_tokens=1, **GREEDY)

    def cached(**salt) -> int:
        [output] = llm.generate({**prompt, **salt}, params, use_tqdm=False)
        return output.num_cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") > 0
    assert cached(cache_salt="b") == 0 and cached() == 0
    assert cached() > 0
    for bad in ("", 5, "x" * 2000):
        with pytest.raises(InvalidRequest) as info:
            llm.generate({**prompt, "cache_salt": bad}, params, use_tqdm=False)
        assert info.value.param == "cache_salt"


def test_allowed_token_ids_and_bad_words(llm):
    [free] = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    tokens = free.outputs[0].token_ids
    allowed = [tokens[0], 9, 10]
    [limited] = llm.generate(PROMPT, SamplingParams(max_tokens=12, allowed_token_ids=allowed, **GREEDY),
                             use_tqdm=False)
    assert set(limited.outputs[0].token_ids) <= set(allowed) < set(allowed) | set(tokens)
    tokenizer = llm.get_tokenizer()
    word = next(w for w in (tokenizer.decode([t]).strip() for t in tokens) if w.isalpha())
    [clean] = llm.generate(PROMPT, SamplingParams(max_tokens=12, bad_words=[word], **GREEDY), use_tqdm=False)
    out = clean.outputs[0].token_ids
    assert not any(out[i:i + len(seq)] == seq for seq in bad_word_token_ids([word], tokenizer)
                   for i in range(len(out)))
    with pytest.raises(InvalidRequest) as info:
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**9]), use_tqdm=False)
    assert info.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequest) as info:  # a lone surrogate (JSON's "\udfff") cannot be tokenized
        SamplingParams(bad_words=["a\udfff"])
    assert info.value.param == "bad_words"


def test_chat_continue_final_message_and_template_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "It jumps"}]
    open_turn = llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    closed = llm.apply_chat_template(messages, add_generation_prompt=False)
    assert tokenizer.decode(open_turn).endswith("It jumps") and closed[:len(open_turn)] == open_turn
    [reply] = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY), add_generation_prompt=False,
                       continue_final_message=True, use_tqdm=False)
    assert reply.prompt_token_ids == open_turn
    template = "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with_var = llm.apply_chat_template(messages[:1], template, chat_template_kwargs={"prefix": "Once more: "})
    assert tokenizer.decode(with_var).startswith("Once more:")
    for kwargs, param in (({"continue_final_message": True}, "continue_final_message"),
                          ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize")):
        with pytest.raises(InvalidRequest) as info:
            llm.chat(messages[:1], SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
        assert info.value.param == param

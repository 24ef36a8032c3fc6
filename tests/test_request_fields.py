"""vLLM's request fields on a real server: each one honoured (a test here observes its effect)
or refused by name, never silently ignored.

``VLLM_FIELDS`` is vLLM 0.32's request field names per endpoint (``../shared/reference``).
``FIELD_TESTS`` names, for every field of tokenmill's request models, the test that
observes it; a field added to the models without a test there fails
``test_every_request_field_has_a_test``.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from conftest import make_llm
from server_harness import running_server
from test_server import metric_values
from tokenmill.core.engine.beam_search import BeamSearchParams
from tokenmill.core.sample.logits_processors.bad_words import bad_word_token_ids
from tokenmill.interfaces.logits_processor import LogitsProcessor
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.request_fields import REFUSED_FIELDS
from tokenmill.testing.tiny_models import BOS_ID

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"

#: vLLM 0.32's request models' field names (CompletionRequest, ChatCompletionRequest)
VLLM_FIELDS = {
    "completions": """add_special_tokens allowed_token_ids bad_words cache_salt ec_transfer_params echo
        frequency_penalty ignore_eos include_stop_str_in_output kv_transfer_params length_penalty logit_bias
        logprob_token_ids logprobs max_tokens min_p min_tokens mm_payload model n presence_penalty priority prompt
        prompt_embeds prompt_logprobs repetition_detection repetition_penalty request_id response_format
        return_mm_kwargs return_token_ids return_token_offsets return_tokens_as_token_ids
        routed_experts_prompt_start seed session_id skip_special_tokens spaces_between_special_tokens stop
        stop_token_ids stream stream_interval stream_options structured_outputs suffix temperature
        thinking_token_budget top_k top_p truncate_prompt_tokens truncation_side use_beam_search user vllm_xargs
        watermarking""".split(),
    "chat": """add_generation_prompt add_special_tokens allowed_token_ids bad_words cache_salt chat_template
        chat_template_kwargs continue_final_message documents ec_transfer_params echo frequency_penalty ignore_eos
        include_reasoning include_stop_str_in_output kv_transfer_params length_penalty logit_bias logprob_token_ids
        logprobs max_completion_tokens max_tokens media_io_kwargs messages min_p min_tokens mm_payload
        mm_processor_kwargs model n parallel_tool_calls presence_penalty priority prompt_logprobs reasoning_effort
        repetition_detection repetition_penalty request_id response_format return_mm_kwargs return_prompt_text
        return_token_ids return_token_offsets return_tokens_as_token_ids routed_experts_prompt_start seed
        session_id skip_special_tokens spaces_between_special_tokens stop stop_token_ids stream stream_interval
        stream_options structured_outputs temperature thinking_token_budget tool_choice tools top_k top_logprobs
        top_p truncate_prompt_tokens truncation_side use_beam_search user vllm_xargs watermarking""".split(),
}

_SHARED_TESTS = {
    "model": "test_server.py::test_default_served_name_is_the_model_argument_as_given",
    "n": "test_server.py::test_prompt_shapes_n_and_indices",
    "temperature": "test_server.py::test_seeded_requests_are_reproducible",
    "top_p": "test_server.py::test_vllm_sampling_extras_are_accepted",
    "presence_penalty": "test_sampler.py::test_repetition_presence_and_frequency_penalties_are_exact",
    "frequency_penalty": "test_sampler.py::test_repetition_presence_and_frequency_penalties_are_exact",
    "seed": "test_server.py::test_seeded_requests_are_reproducible",
    "stop": "test_engine.py::test_stop_strings_cut_text_and_report_the_reason",
    "stream": "test_server.py::test_streamed_text_equals_non_streamed",
    "stream_options": "test_server.py::test_stream_usage_chunk",
    "stream_interval": "test_server.py::test_stream_interval_sends_the_first_token_then_chunks_of_that_many",
    "user": "test_user_and_priority_reach_the_scheduler",
    "logit_bias": "test_sampler.py::test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw",
    "top_k": "test_sampler.py::test_top_k_samples_stay_in_the_top_k",
    "min_p": "test_sampler.py::test_min_p_samples_are_likely_enough",
    "repetition_penalty": "test_sampler.py::test_repetition_presence_and_frequency_penalties_are_exact",
    "min_tokens": "test_sampler.py::test_min_tokens_masks_stop_tokens_until_reached",
    "ignore_eos": "test_engine.py::test_eos_stops_unless_ignored",
    "stop_token_ids": "test_engine.py::test_stop_token_ids_and_min_tokens",
    "priority": "test_user_and_priority_reach_the_scheduler",
    "include_stop_str_in_output": "test_engine.py::test_stop_strings_cut_text_and_report_the_reason",
    "skip_special_tokens": "test_server.py::test_vllm_sampling_extras_are_accepted",
    "spaces_between_special_tokens": "test_server_errors.py::test_bad_input_gets_documented_status_and_envelope",
    "request_id": "test_server_errors.py::test_client_request_ids_cannot_collide",
    "allowed_token_ids": "test_allowed_token_ids_limit_the_output",
    "bad_words": "test_bad_words_disappear_from_the_output",
    "truncate_prompt_tokens": "test_truncate_prompt_tokens_keeps_the_chosen_end",
    "truncation_side": "test_truncate_prompt_tokens_keeps_the_chosen_end",
    "prompt_logprobs": "test_prompt_logprobs_equal_hf",
    "return_tokens_as_token_ids": "test_return_tokens_as_token_ids",
    "return_token_ids": "test_return_token_ids",
    "cache_salt": "test_cache_salt_keeps_prefix_blocks_apart",
    "vllm_xargs": "test_vllm_xargs_reach_a_logits_processor",
    "response_format": "test_structured_outputs.py::test_every_reply_follows_its_json_schema",
    "structured_outputs": "test_structured_outputs.py::test_regex_and_choice_match_fully",
    "guided_json": "test_structured_outputs.py::test_completions_take_every_spelling_of_a_constraint",
    "guided_regex": "test_structured_outputs.py::test_regex_and_choice_match_fully",
    "guided_choice": "test_structured_outputs.py::test_regex_and_choice_match_fully",
    "guided_grammar": "test_structured_outputs.py::test_an_ebnf_grammar_parses",
    "use_beam_search": "test_use_beam_search_equals_offline_beam_search",
    "length_penalty": "test_use_beam_search_equals_offline_beam_search",
}
#: every field of tokenmill's request models -> the test that observes it ("file::name", or a name here)
FIELD_TESTS = {
    "completions": {
        **_SHARED_TESTS,
        "prompt": "test_server.py::test_prompt_shapes_n_and_indices",
        "max_tokens": "test_server_errors.py::test_bad_input_gets_documented_status_and_envelope",
        "logprobs": "test_server.py::test_echo_with_logprobs_gives_prompt_logprobs",
        "echo": "test_server.py::test_echo_with_logprobs_gives_prompt_logprobs",
        "best_of": "test_best_of_other_than_n_is_refused",
        "add_special_tokens": "test_add_special_tokens",
    },
    "chat": {
        **_SHARED_TESTS,
        "messages": "test_server.py::test_chat_logprobs_and_top_logprobs",
        "max_tokens": "test_server.py::test_chat_logprobs_and_top_logprobs",
        "max_completion_tokens": "test_server.py::test_chat_logprobs_and_top_logprobs",
        "logprobs": "test_server.py::test_chat_logprobs_and_top_logprobs",
        "top_logprobs": "test_server.py::test_chat_logprobs_and_top_logprobs",
        "add_generation_prompt": "test_continue_final_message_leaves_the_turn_open",
        "chat_template": "test_chat_template_kwargs_reach_the_template",
        "chat_template_kwargs": "test_chat_template_kwargs_reach_the_template",
        "continue_final_message": "test_continue_final_message_leaves_the_turn_open",
        "echo": "test_chat_echo_starts_with_the_open_assistant_message",
        "add_special_tokens": "test_add_special_tokens",
        "tools": "test_structured_outputs.py::test_a_named_tool_choice_returns_valid_arguments",
        "tool_choice": "test_structured_outputs.py::test_required_tool_choice_returns_calls_of_the_given_tools",
        "parallel_tool_calls": "test_structured_outputs.py::test_required_tool_choice_returns_calls_of_the_given_tools",
        "include_reasoning": "test_reasoning_parsers.py::test_replies_carry_reasoning_content_whole_and_streamed",
        "reasoning_effort": "test_reasoning_parsers.py::test_reasoning_effort_reaches_the_chat_template",
    },
}


class ForceToken(LogitsProcessor):
    """A test processor: rows whose extra_args name a ``force_token`` can only produce it."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self._rows: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params) -> None:
        token = (params.extra_args or {}).get("force_token")
        if token is not None and not isinstance(token, int):
            raise ValueError(f"force_token must be a token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update) -> None:
        if update is not None:
            update.apply_to(self._rows, lambda row: (row.params.extra_args or {}).get("force_token"))

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self._rows.items():
            keep = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = keep
        return logits


@pytest.fixture(scope="module")
def bos_model(model_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a tokenizer that adds BOS to text, as Llama's own does (so that
    add_special_tokens has something to leave out)."""
    path = tmp_path_factory.mktemp("bos-llama")
    shutil.copytree(model_dir("llama"), path, dirs_exist_ok=True)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    bos = {"id": "<|bos|>", "type_id": 0}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [BOS_ID], "tokens": ["<|bos|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture(scope="module")
def served(bos_model):
    engine = make_llm(bos_model, max_num_seqs=16, logits_processors=[f"{__name__}:ForceToken"]).llm_engine
    with running_server(engine, served_model_name=[MODEL], trust_request_chat_template=True) as (url, llm):
        yield url, llm


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def complete(url: str, **body) -> dict:
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                         "temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def chat(url: str, messages: list[dict], **body) -> dict:
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                              "max_tokens": 8, "temperature": 0, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# --- the field policy ------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint,model", [("completions", CompletionRequest), ("chat", ChatCompletionRequest)])
def test_every_request_field_has_a_test(endpoint, model):
    """A field in the request models must name a test that exists and observes it."""
    tests = FIELD_TESTS[endpoint]
    assert set(model.model_fields) == set(tests), "fields without a test, or tests of no field: " + repr(
        set(model.model_fields) ^ set(tests))
    here = Path(__file__).parent
    defined: dict[str, set[str]] = {}
    for target in set(tests.values()):
        file, _, name = target.rpartition("::")
        path = here / (file or Path(__file__).name)
        if path not in defined:
            defined[path] = {node.name for node in ast.walk(ast.parse(path.read_text()))
                             if isinstance(node, ast.FunctionDef)}
        assert name in defined[path], f"{target} is not a test in {path.name}"


@pytest.mark.parametrize("endpoint,model", [("completions", CompletionRequest), ("chat", ChatCompletionRequest)])
def test_every_vllm_field_is_implemented_or_refused(endpoint, model):
    unplaced = [name for name in VLLM_FIELDS[endpoint]
                if name not in model.model_fields and name not in REFUSED_FIELDS[endpoint]]
    assert not unplaced, f"vLLM fields neither implemented nor refused: {unplaced}"
    assert not set(model.model_fields) & set(REFUSED_FIELDS[endpoint])


@pytest.mark.parametrize("endpoint,name", [(e, n) for e in REFUSED_FIELDS for n in REFUSED_FIELDS[e]])
def test_refused_fields_are_a_400_naming_the_field(url, endpoint, name):
    body = {"model": MODEL, "max_tokens": 2, **({"prompt": "hi"} if endpoint == "completions"
                                                 else {"messages": [{"role": "user", "content": "hi"}]})}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    for inert in REFUSED_FIELDS[endpoint][name].inert:  # the value that asks for nothing passes
        assert httpx.post(url + path, json={**body, name: inert}, timeout=60).status_code == 200
    response = httpx.post(url + path, json={**body, name: {"asks": "for something"}}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == name
    assert "not supported" in response.json()["error"]["message"]


def test_unknown_fields_are_ignored_with_one_warning_naming_them(url):
    with capture_logs() as logs:
        complete(url, frobnicate=1, zz_vendor_extra={"a": 1})
    warnings = [entry for entry in logs if entry.get("fields")]
    assert len(warnings) == 1 and warnings[0]["fields"] == ["frobnicate", "zz_vendor_extra"]
    assert warnings[0]["log_level"] == "warning"


# --- each field's effect ---------------------------------------------------------------------

def test_allowed_token_ids_limit_the_output(url):
    free = complete(url, return_token_ids=True)["choices"][0]["token_ids"]
    allowed = [free[1], 17, 42]
    assert set(free) - set(allowed), "the unconstrained output must leave the set, or the test proves nothing"
    for path in ("completions", "chat"):
        if path == "completions":
            out = complete(url, allowed_token_ids=allowed, return_token_ids=True)["choices"][0]["token_ids"]
        else:
            out = chat(url, [{"role": "user", "content": PROMPT}], allowed_token_ids=allowed,
                       return_token_ids=True)["choices"][0]["token_ids"]
        assert out and set(out) <= set(allowed), (path, out)


def test_bad_words_disappear_from_the_output(url, served):
    tokenizer = served[1].engine.tokenizer
    free = complete(url, return_token_ids=True, max_tokens=16)["choices"][0]["token_ids"]
    word = next(w for w in (tokenizer.decode([t]).strip() for t in free) if w.isalpha())
    banned = bad_word_token_ids([word], tokenizer)
    assert any(free[i:i + len(seq)] == seq for seq in banned for i in range(len(free)))
    out = complete(url, return_token_ids=True, max_tokens=16, bad_words=[word])["choices"][0]["token_ids"]
    assert not any(out[i:i + len(seq)] == seq for seq in banned for i in range(len(out))), (word, out)
    assert out != free


def test_truncate_prompt_tokens_keeps_the_chosen_end(url, served):
    full = served[1].engine.tokenizer.encode(PROMPT)
    left = complete(url, truncate_prompt_tokens=5, return_token_ids=True)
    assert left["usage"]["prompt_tokens"] == 5 and left["choices"][0]["prompt_token_ids"] == full[-5:]
    right = complete(url, truncate_prompt_tokens=5, truncation_side="right", return_token_ids=True)
    assert right["choices"][0]["prompt_token_ids"] == full[:5]
    # a prompt past the context is made to fit; -1 keeps as many tokens as fit beside max_tokens
    long = " ".join([PROMPT] * 200)
    cut = complete(url, prompt=long, truncate_prompt_tokens=-1, max_tokens=4)
    assert cut["usage"]["prompt_tokens"] == served[1].engine.max_model_len - 4
    message = [{"role": "user", "content": PROMPT}]
    assert chat(url, message, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3
    bad = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def _hf_prompt_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_equal_hf(url, bos_model):
    body = complete(url, prompt_logprobs=2, max_tokens=1, return_token_ids=True)
    choice = body["choices"][0]
    ids = choice["prompt_token_ids"]
    reference = _hf_prompt_logprobs(bos_model, ids)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for position in range(1, len(ids)):
        entry = {int(t): lp for t, lp in entries[position].items()}
        expected_top = reference[position - 1].topk(2).indices.tolist()
        assert set(expected_top) <= set(entry) and len(entry) <= 3
        for token, lp in entry.items():
            assert abs(lp["logprob"] - float(reference[position - 1, token])) < 1e-4
        assert entry[ids[position]]["rank"] == int((reference[position - 1] > reference[position - 1, ids[position]]).sum()) + 1
    chat_body = chat(url, [{"role": "user", "content": PROMPT}], prompt_logprobs=0, return_token_ids=True)
    ids = chat_body["prompt_token_ids"]
    reference = _hf_prompt_logprobs(bos_model, ids)
    for position in range(1, len(ids)):
        [(token, lp)] = chat_body["prompt_logprobs"][position].items()
        assert int(token) == ids[position]
        assert abs(lp["logprob"] - float(reference[position - 1, ids[position]])) < 1e-4


def test_return_tokens_as_token_ids(url):
    body = complete(url, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    reply = chat(url, [{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=2,
                 return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    assert [c["token"] for c in reply["logprobs"]["content"]] == [f"token_id:{t}" for t in reply["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in reply["logprobs"]["content"] for t in c["top_logprobs"])


def test_return_token_ids(url, served):
    tokenizer = served[1].engine.tokenizer
    choice = complete(url, return_token_ids=True)["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    assert "token_ids" not in complete(url)["choices"][0] or complete(url)["choices"][0]["token_ids"] is None
    events = stream_events(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                    "return_token_ids": True})
    assert sum((e["choices"][0]["token_ids"] for e in events if e["choices"]), []) == choice["token_ids"][:6]


def test_add_special_tokens(url, served):
    tokenizer = served[1].engine.tokenizer
    assert tokenizer.bos_token_id is not None and tokenizer.encode(PROMPT)[0] == tokenizer.bos_token_id
    with_bos = complete(url, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    without = complete(url, add_special_tokens=False, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert with_bos == [tokenizer.bos_token_id] + without
    message = [{"role": "user", "content": PROMPT}]
    plain = chat(url, message, return_token_ids=True)["prompt_token_ids"]
    added = chat(url, message, add_special_tokens=True, return_token_ids=True)["prompt_token_ids"]
    assert added == tokenizer.encode(tokenizer.decode(plain), add_special_tokens=True) and len(added) > len(plain)


def test_continue_final_message_leaves_the_turn_open(url, served):
    tokenizer = served[1].engine.tokenizer
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "It jumps"}]
    closed = chat(url, messages, add_generation_prompt=False, return_token_ids=True)["prompt_token_ids"]
    open_turn = chat(url, messages, add_generation_prompt=False, continue_final_message=True,
                     return_token_ids=True)["prompt_token_ids"]
    assert tokenizer.decode(open_turn).endswith("It jumps")
    assert len(open_turn) < len(closed) and closed[:len(open_turn)] == open_turn
    refused = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                             "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_starts_with_the_open_assistant_message(url):
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "It jumps"}]
    common = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(url, messages, **common)["choices"][0]["message"]["content"]
    echoed = chat(url, messages, echo=True, **common)["choices"][0]["message"]["content"]
    assert echoed == "It jumps" + plain
    events = stream_events(url, "/v1/chat/completions", {"messages": messages, "echo": True, "max_tokens": 8,
                                                         "temperature": 0, **common})
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == echoed
    # a user's last message is not echoed (the reply is a new turn)
    user_last = chat(url, messages[:1], echo=True)["choices"][0]["message"]["content"]
    assert user_last == chat(url, messages[:1])["choices"][0]["message"]["content"]


def test_chat_template_kwargs_reach_the_template(url):
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = [{"role": "user", "content": " and more"}]
    body = chat(url, message, chat_template=template, chat_template_kwargs={"greeting": "Hello there"},
                return_token_ids=True)
    tokens = body["prompt_token_ids"]
    plain = chat(url, message, chat_template=template, return_token_ids=True)["prompt_token_ids"]
    assert len(tokens) > len(plain)
    reserved = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": message,
                                                              "chat_template_kwargs": {"tokenize": True}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_continuous_usage_stats_put_usage_in_every_chunk(url):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        events = stream_events(url, path, {**body, "max_tokens": 6, "temperature": 0, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        token_chunks = [e for e in events if e["choices"] and (e["choices"][0].get("text") or
                                                                e["choices"][0].get("delta", {}).get("content")
                                                                or e["choices"][0]["finish_reason"])]
        assert token_chunks and all(e.get("usage") for e in token_chunks), path
        counts = [e["usage"]["completion_tokens"] for e in token_chunks]
        assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"] == 6
        plain = stream_events(url, path, {**body, "max_tokens": 6, "stream_options": {"include_usage": True}})
        assert [e for e in plain if e.get("usage")] == [plain[-1]]


def test_cache_salt_keeps_prefix_blocks_apart(url):
    prompt = " ".join(["Salted tenants never share a cached block"] * 6)  # several full blocks, none cached yet

    def hits_after(**body) -> float:
        before = metric_values(url)["tokenmill:prefix_cache_hits_total"]
        complete(url, prompt=prompt, max_tokens=1, **body)
        return metric_values(url)["tokenmill:prefix_cache_hits_total"] - before

    hits_after(cache_salt="tenant-a")
    assert hits_after(cache_salt="tenant-a") > 0  # the same salt shares
    assert hits_after(cache_salt="tenant-b") == 0  # another salt does not
    assert hits_after() == 0  # nor does no salt
    assert hits_after() > 0


def test_vllm_xargs_reach_a_logits_processor(url, served):
    forced = complete(url, vllm_xargs={"force_token": 42}, return_token_ids=True)["choices"][0]["token_ids"]
    assert forced == [42] * 12
    assert complete(url, return_token_ids=True)["choices"][0]["token_ids"] != forced
    refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                        "vllm_xargs": {"force_token": "x"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs"
    nested = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                       "vllm_xargs": {"a": {"b": 1}}})
    assert nested.status_code == 400


def test_use_beam_search_equals_offline_beam_search(url, client, bos_model):
    for n, penalty in ((2, 1.0), (3, 0.5)):
        body = complete(url, use_beam_search=True, n=n, length_penalty=penalty, max_tokens=6,
                        return_token_ids=True)
        offline = _offline_beams(bos_model, n, penalty)
        assert [c["prompt_token_ids"] + c["token_ids"] for c in body["choices"]] == offline
        streamed = stream_events(url, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": n,
                                                          "length_penalty": penalty, "max_tokens": 6})
        assert [c["text"] for c in streamed[0]["choices"]] == [c["text"] for c in body["choices"]]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=2,
                                           max_tokens=5, extra_body={"use_beam_search": True})
    assert len(reply.choices) == 2 and reply.choices[0].message.content != reply.choices[1].message.content
    for field, value in (("temperature", 0.8), ("logprobs", 1), ("stop", ["x"])):
        refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                            "use_beam_search": True, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    alone = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "length_penalty": 2.0})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "length_penalty"


def _offline_beams(path: Path, n: int, penalty: float) -> list[list[int]]:
    """The offline API's beam search on the same weights (held to HF in test_beam_search.py)."""
    [output] = make_llm(path).beam_search(
        [PROMPT], BeamSearchParams(beam_width=n, max_tokens=6, length_penalty=penalty))
    return [sequence.tokens for sequence in output.sequences]


def test_user_and_priority_reach_the_scheduler(url, served):
    engine = served[1].engine
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "user": "tenant-7", "priority": 3}, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        seen = [(r.user, r.priority) for r in list(engine.scheduler.requests.values())]
    assert ("tenant-7", 3) in seen


def test_best_of_other_than_n_is_refused(url):
    assert complete(url, n=2, best_of=2, temperature=1.0, max_tokens=2)["choices"][1]["index"] == 1
    refused = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "best_of": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_builtin_processors_min_tokens_and_logit_bias_on_the_server(url):
    """The two built-ins whose fields predate the processor contract, observed end to end."""
    first = complete(url, return_token_ids=True)["choices"][0]["token_ids"][0]
    stopped = complete(url, stop_token_ids=[first], return_token_ids=True)["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) == 1
    held = complete(url, stop_token_ids=[first], min_tokens=5, return_token_ids=True)["choices"][0]
    assert len(held["token_ids"]) >= 5 and first not in held["token_ids"][:4]
    biased = complete(url, logit_bias={"77": 100}, return_token_ids=True)["choices"][0]["token_ids"]
    assert biased == [77] * 12
    chat_biased = chat(url, [{"role": "user", "content": PROMPT}], logit_bias={"77": 100},
                       return_token_ids=True)["choices"][0]["token_ids"]
    assert chat_biased == [77] * 8

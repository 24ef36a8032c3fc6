"""``tokenmill serve`` takes a ``vllm serve`` command line: every vLLM 0.32 flag is honoured,
accepted because tokenmill already does what it asks, or refused by name at startup with
the reason (exit 2, before the model loads); ``--config`` reads vLLM's flat YAML too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_harness import free_port, wait_until_healthy
from test_cli import tokenmill
from tokenmill.cli.command import serve_flags
from tokenmill.server.vllm_flags import ALREADY_SO, INERT, REFUSED, VLLM_SERVE_FLAGS, markdown_table

README = Path(__file__).parents[1] / "README.md"


def test_every_vllm_flag_is_honoured_accepted_or_refused_by_name():
    assert len(VLLM_SERVE_FLAGS) == 317
    honoured = serve_flags()
    unclassified = [f for f in VLLM_SERVE_FLAGS if f not in honoured and f not in ALREADY_SO and f not in REFUSED]
    assert not unclassified, unclassified
    assert not (set(REFUSED) | set(ALREADY_SO)) - set(VLLM_SERVE_FLAGS)  # no stale entries
    assert not set(REFUSED) & honoured and not set(ALREADY_SO) & honoured and not set(REFUSED) & set(ALREADY_SO)
    assert all(flag in REFUSED for flag in INERT)


def test_the_readme_table_is_the_tables_own():
    assert markdown_table(serve_flags()) in README.read_text()


@pytest.mark.parametrize("flags,named", [
    (["--revision", "main"], "--revision"),
    (["--enable-expert-parallel"], "--enable-expert-parallel"),
    (["--load-format", "pt"], "--load-format"),
    (["--data-parallel-size", "2"], "--data-parallel-size"),
    (["--reasoning-parser-plugin", "my_parser.py"], "--reasoning-parser-plugin"),
])
def test_a_refused_flag_fails_at_startup_naming_it_and_why(flags, named):
    result = tokenmill("serve", "/nonexistent-model", *flags)
    assert result.returncode == 2
    assert result.stderr.startswith(f"tokenmill serve: {named} is refused: ") and "Traceback" not in result.stderr
    assert REFUSED[named] in result.stderr


def test_unknown_flags_still_fail_as_argparse_does():
    result = tokenmill("serve", "--no-such-flag")
    assert result.returncode == 2 and "unrecognized arguments: --no-such-flag" in result.stderr


def test_a_vllm_deployment_line_serves_with_its_inert_and_accepted_flags(tmp_path):
    """vLLM's flags as a deployment script passes them: honoured, inert values of refused
    ones, already-so ones (logged), a flag for another platform (warned about), and the rest
    from vLLM's flat YAML in --config, which the command line overrides."""
    config = tmp_path / "vllm.yaml"
    config.write_text("max-model-len: 128\nmax_num_seqs: 2\nenable-prefix-caching: true\n")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--config", str(config), "--port", str(port),
         "--served-model-name", "demo", "--kv-cache-memory-bytes", "16MiB", "--log-format", "json",
         "--gpu-memory-utilization", "0.85", "--max-num-seqs", "4", "--enable-chunked-prefill",
         "--load-format", "safetensors", "--tokenizer-mode", "auto", "--generation-config", "auto",
         "--disable-log-stats", "--max-log-len", "100", "--data-parallel-size", "1", "--disable-log-requests",
         "--uvicorn-log-level", "warning", "--chat-template", str(template), "--quantization", "fp8",
         "--enable-prefix-caching", "--max-num-seqs", "512", "--reasoning-parser", "qwen3", "--cpu-offload-gb", "4"],
        env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, process=process)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "demo", "prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    built = next(line for line in lines if line["event"] == "engine built")
    assert built["max_model_len"] == 128  # from the YAML
    ignored = next(line for line in lines if line["event"] == "options ignored")
    assert sorted(ignored["flags"]) == ["--cpu-offload-gb", "--gpu-memory-utilization"]
    assert ignored["section"] == "platform.cuda"
    accepted = next(line for line in lines if line["event"] == "vLLM flags accepted, nothing to do")
    assert any(item.startswith("--disable-log-stats") for item in accepted["flags"])
    assert not any(line["event"] == "request finished" for line in lines)  # --disable-log-requests
    assert "Uvicorn running" not in stderr  # uvicorn's info lines are below --uvicorn-log-level warning


def test_the_command_line_overrides_the_vllm_yaml(tmp_path, model_dir):
    config = tmp_path / "vllm.yaml"
    config.write_text("max-model-len: 128\nkv-cache-memory-bytes: 8MiB\nblock-size: 8\n")
    generated = tokenmill("generate", "--config", str(config), "--model", str(model_dir("llama")), "--prompt", "x",
                          "--max-tokens", "2", "--max-model-len", "64", "--json")
    assert generated.returncode == 0, generated.stderr
    assert "max_model_len=64" in generated.stderr


def test_bench_help_prints_help():
    result = tokenmill("bench", "--help")
    assert result.returncode == 0 and "throughput,latency,serve" in result.stdout
    assert tokenmill("bench").returncode == 2


def test_chat_template_flag_renders_every_chat_request(tmp_path, model_dir):
    """--chat-template FILE (or the template itself) replaces the tokenizer's for chat
    requests and /tokenize; a value that is neither fails at startup, before the model loads."""
    from transformers import AutoTokenizer

    from conftest import make_llm
    from server_harness import running_server

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    expected = tokenizer.encode("[user] hello there\n[assistant]", add_special_tokens=False)
    messages = [{"role": "user", "content": "hello there"}]
    for value in (str(template), template.read_text()):
        engine = make_llm(model_dir("llama")).llm_engine
        with running_server(engine, served_model_name=["m"], chat_template=value) as (base, _):
            tokens = httpx.post(base + "/tokenize", json={"model": "m", "messages": messages}).json()["tokens"]
            reply = httpx.post(base + "/v1/chat/completions", timeout=60,
                               json={"model": "m", "messages": messages, "max_tokens": 2}).json()
        assert tokens == expected and reply["usage"]["prompt_tokens"] == len(expected)
    missing = tokenmill("serve", "/nonexistent-model", "--chat-template", str(tmp_path / "nope.jinja"))
    assert missing.returncode == 2 and "chat_template" in missing.stderr and "Traceback" not in missing.stderr


def test_return_tokens_as_token_ids_flag_names_every_requests_logprob_tokens(model_dir):
    from conftest import make_llm
    from server_harness import running_server

    engine = make_llm(model_dir("llama")).llm_engine
    with running_server(engine, served_model_name=["m"], return_tokens_as_token_ids=True) as (base, _):
        completion = httpx.post(base + "/v1/completions", timeout=60,
                                json={"model": "m", "prompt": "Hi", "max_tokens": 3, "logprobs": 1}).json()
        chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True}).json()
    assert all(token.startswith("token_id:") for token in completion["choices"][0]["logprobs"]["tokens"])
    assert all(entry["token"].startswith("token_id:") for entry in chat["choices"][0]["logprobs"]["content"])


def test_max_logprobs_flag_limits_every_request(model_dir, tmp_path):
    from conftest import make_llm
    from server_harness import running_server

    engine = make_llm(model_dir("llama")).llm_engine
    with running_server(engine, served_model_name=["m"], max_logprobs=2) as (base, _):
        allowed = httpx.post(base + "/v1/completions", timeout=60,
                             json={"model": "m", "prompt": "Hi", "max_tokens": 2, "logprobs": 2})
        refused = httpx.post(base + "/v1/completions", timeout=60,
                             json={"model": "m", "prompt": "Hi", "max_tokens": 2, "logprobs": 3})
        chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 5})
        prompt = httpx.post(base + "/v1/completions", timeout=60,
                            json={"model": "m", "prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 4})
    assert allowed.status_code == 200
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt_logprobs"
    assert tokenmill("serve", "/nonexistent-model", "--max-logprobs", "50").returncode == 2


def _served(model_dir, **server_config):
    from conftest import make_llm
    from server_harness import running_server

    return running_server(make_llm(model_dir("llama"), **server_config.pop("engine", {})).llm_engine,
                          served_model_name=["m"], **server_config)


def test_response_role_flag_names_the_role_of_replies_to_a_generation_prompt(model_dir):
    """vLLM's rule: the server's role for a reply to the generation prompt, whole and streamed;
    a reply that continues the last message (add_generation_prompt false) takes its role."""
    messages = [{"role": "user", "content": "Hi"}]
    with _served(model_dir, response_role="narrator") as (base, _):
        whole = httpx.post(base + "/v1/chat/completions", timeout=60,
                           json={"model": "m", "messages": messages, "max_tokens": 2}).json()
        streamed = httpx.post(base + "/v1/chat/completions", timeout=60,
                              json={"model": "m", "messages": messages, "max_tokens": 2, "stream": True}).text
        continued = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": 2, "add_generation_prompt": False}).json()
    assert whole["choices"][0]["message"]["role"] == "narrator"
    first = json.loads(streamed.split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "narrator"
    assert continued["choices"][0]["message"]["role"] == "user"


def test_chat_template_content_format_openai_passes_content_parts_to_the_template(model_dir):
    """"openai": the template reads each message's content as OpenAI's list of parts (a plain
    string becomes one text part); "string" (the default) joins them into one text."""
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}{% if m.content is string %}<{{ m.content }}>{% else %}"
                "{% for part in m.content %}[{{ part.text }}]{% endfor %}{% endif %}{% endfor %}")
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    for fmt, rendered in (("openai", "[be brief][a][b]"), ("string", "<be brief><ab>")):
        with _served(model_dir, chat_template=template, chat_template_content_format=fmt) as (base, _):
            tokens = httpx.post(base + "/tokenize", json={"model": "m", "messages": messages}).json()["tokens"]
        assert tokens == tokenizer.encode(rendered, add_special_tokens=False), fmt


def test_prompt_tokens_details_flag_reports_the_prefix_caches_tokens(model_dir):
    """The second of two requests with one long prompt is served from the prefix cache, and
    says how much; without the flag usage has no details."""
    prompt = "the same long prompt " * 12
    request = {"model": "m", "prompt": prompt, "max_tokens": 2}
    chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with _served(model_dir, enable_prompt_tokens_details=True, engine={"enable_prefix_caching": True}) as (base, _):
        first = httpx.post(base + "/v1/completions", json=request, timeout=60).json()["usage"]
        second = httpx.post(base + "/v1/completions", json=request, timeout=60).json()["usage"]
        httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
        events = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).text.split("\n\n")
    streamed = json.loads(events[-3].removeprefix("data: "))["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert 0 < streamed["prompt_tokens_details"]["cached_tokens"] < streamed["prompt_tokens"]
    with _served(model_dir, engine={"enable_prefix_caching": True}) as (base, _):
        plain = httpx.post(base + "/v1/completions", json=request, timeout=60).json()["usage"]
    assert plain.get("prompt_tokens_details") is None


def test_middleware_flag_adds_classes_and_functions(model_dir):
    """--middleware IMPORT.PATH (repeatable): a class as ASGI middleware, an async function as
    an HTTP middleware, both around every route; anything else fails at startup by name."""
    from tokenmill.interfaces.errors import ConfigError

    paths = ["vllm_middleware.TagResponses", "vllm_middleware:count_requests"]
    with _served(model_dir, middleware=paths) as (base, _):
        response = httpx.get(base + "/v1/models")
    assert response.headers["x-tagged-by"] == "class" and response.headers["x-seen"] == "yes"
    for bad in ("vllm_middleware.NOT_MIDDLEWARE", "vllm_middleware.nowhere"):
        with pytest.raises(ConfigError, match="server.middleware"):
            with _served(model_dir, middleware=[bad]):
                pass
    refused = tokenmill("serve", "/nonexistent-model", "--middleware", "no_such_module.f")
    assert refused.returncode == 2 and "server.middleware" in refused.stderr and "Traceback" not in refused.stderr


def test_structured_outputs_config_flag(model_dir):
    """vLLM's --structured-outputs-config JSON: its backend, its reasoning parser (used when
    --reasoning-parser is not given), enable_in_reasoning (the constraint holds in the thinking
    too), disable_additional_properties (every open schema object closed); a whitespace-free
    JSON is the only JSON (disable_any_whitespace false is refused by name)."""
    from tokenmill.core.config.engine_config import load_config
    from tokenmill.interfaces.errors import ConfigError
    from tokenmill.interfaces.structured_output import StructuredOutputsParams

    config = load_config(model=str(model_dir("llama")), structured_outputs_config=json.dumps(
        {"backend": "guidance", "reasoning_parser": "qwen3", "enable_in_reasoning": True,
         "disable_additional_properties": True, "disable_fallback": True, "reasoning_parser_plugin": ""}))
    assert config.structured_outputs.backend == "guidance"
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}}
    with _served(model_dir, engine={"structured_outputs_config": config.structured_outputs.model_dump_json()}) \
            as (base, llm):
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30,
            "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                            "required": ["a"], "additionalProperties": False}}}).json()
        closed = llm.engine.structured_outputs.compiled(StructuredOutputsParams(json=schema)).new_matcher()
    # qwen3 (from the config) read the reply as an answer, and the constraint held from its
    # first token: without enable_in_reasoning it would wait for a </think> that never comes
    assert json.loads(reply["choices"][0]["message"]["content"]) in ({"a": True}, {"a": False})
    tokenizer = llm.engine.tokenizer
    assert not all(closed.accept_token(t) for t in tokenizer.encode('{"other"', add_special_tokens=False))
    with pytest.raises(ConfigError, match="disable_any_whitespace"):
        load_config(model="x", structured_outputs_config='{"disable_any_whitespace": false}')
    with pytest.raises(ConfigError, match="reasoning_parser_plugin"):
        load_config(model="x", structured_outputs_config='{"reasoning_parser_plugin": "p.py"}')


def test_hf_overrides_flag_changes_the_config_the_model_is_built_from(model_dir):
    """--hf-overrides JSON: the model is built from config.json with those keys replaced, and
    its logprobs equal transformers' built from the same overrides (max_position_embeddings
    bounds max_model_len; rms_norm_eps changes every layer's output)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, load_config
    from tokenmill.testing.logits import prompt_logits

    path, prompt = model_dir("llama"), list(range(5, 30))
    overrides = {"rms_norm_eps": 0.25, "max_position_embeddings": 96}
    config = load_config(model=str(path), dtype="float32", kv_cache_memory_bytes=2**24,
                         hf_overrides=json.dumps(overrides))
    engine = LLM(config=config).llm_engine
    assert engine.max_model_len == 96
    got = prompt_logits(engine, prompt).log_softmax(-1)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides)
        expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([prompt])).logits[0]
    assert (got - expected).abs().max().item() < 1e-4
    assert (plain.log_softmax(-1) - expected).abs().max().item() > 1e-2  # the override mattered


def test_long_prefill_token_threshold_caps_each_steps_prefill_chunk(model_dir):
    """--long-prefill-token-threshold 8: a 40-token prompt prefills in 8-token chunks over five
    steps (one without it), beside a short prompt that starts at once, with the same tokens."""
    from conftest import make_llm
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long_prompt, short_prompt = list(range(3, 43)), list(range(50, 54))
    results = {}
    for threshold in (0, 8):
        engine = make_llm(model_dir("llama"), long_prefill_token_threshold=threshold).llm_engine
        engine.add_request("long", {"prompt_token_ids": long_prompt}, params)
        engine.add_request("short", {"prompt_token_ids": short_prompt}, params)
        first_token_step, done, step = {}, {}, 0
        while engine.has_unfinished_requests():
            step += 1
            for output in engine.step():
                if output.outputs[0].token_ids:
                    first_token_step.setdefault(output.request_id, step)
                if output.finished:
                    done[output.request_id] = output.outputs[0].token_ids
        results[threshold] = first_token_step, done
    assert results[0][0] == {"long": 1, "short": 1}
    assert results[8][0] == {"long": 5, "short": 1}
    assert results[8][1] == results[0][1]

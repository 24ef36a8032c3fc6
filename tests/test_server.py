"""The OpenAI-compatible server, driven by the official openai client and raw httpx
against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import PROMPTS, make_llm
from server_harness import running_server
from tokenmill.server.generation import sse

MODEL = "tiny"


@pytest.fixture(scope="module", params=[{}, dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                ids=["one-process", "tp2", "pp2"])
def server(model_dir, request):
    """The API over a one-process engine, and over tensor- and pipeline-parallel ones."""
    engine = make_llm(model_dir("llama"), max_num_seqs=64, **request.param).llm_engine
    with running_server(engine, served_model_name=[MODEL], api_key="sekret", max_request_body_bytes=64 * 1024,
                        max_queued_requests=512) as (url, llm):
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="sekret", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="sekret", max_retries=0, timeout=120)


def auth(key="sekret"):
    return {"Authorization": f"Bearer {key}"}


def metric_values(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def test_completion_matches_offline_engine(client, model_dir):
    """Greedy text over HTTP equals the offline LLM's for the same prompt."""
    from tokenmill import SamplingParams

    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    offline = make_llm(model_dir("llama")).generate({"prompt_token_ids": PROMPTS[0]},
                                                    SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert response.choices[0].text == offline[0].outputs[0].text
    assert response.usage.prompt_tokens == len(PROMPTS[0]) and response.usage.completion_tokens == 10


def test_streamed_text_equals_non_streamed(client):
    """Concatenated stream deltas equal the non-streamed text, for completions and chat."""
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, stop=[" the"])
    full = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == full.finish_reason

    messages = [{"role": "user", "content": "Tell me about rivers"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                   stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


def test_a_stream_of_n_choices_adds_up_to_the_response_with_each_choice_opened_by_the_prompt(server):
    """A stream's chunks carry what is new; each of n choices adds up to the non-streamed choice
    (text, token ids, logprobs), and each one's first chunk has the prompt's logprobs and ids."""
    url = server[0]
    body = {"model": MODEL, "prompt": "The cat sat on the mat", "max_tokens": 12, "n": 2, "temperature": 1.0,
            "seed": 7, "logprobs": 1, "prompt_logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=60).json()["choices"]
    events = httpx.post(url + "/v1/completions", json={**body, "stream": True}, headers=auth(), timeout=60).text
    chunks = [json.loads(line[len("data: "):]) for line in events.splitlines()
              if line.startswith("data: {")]
    for expected in full:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == expected["index"]]
        assert "".join(c["text"] for c in mine) == expected["text"]
        assert sum((c["token_ids"] for c in mine), []) == expected["token_ids"]
        assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) == expected["logprobs"]["token_logprobs"]
        assert mine[0]["prompt_logprobs"] == expected["prompt_logprobs"] is not None
        assert mine[0]["prompt_token_ids"] == expected["prompt_token_ids"]
        assert all("prompt_logprobs" not in c for c in mine[1:])
        assert mine[-1]["finish_reason"] == expected["finish_reason"] == "length"


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    events = httpx.post(url + path, json={**body, "stream": True}, headers=auth(), timeout=60).text
    return [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: {")]


def _ends(chunks: list[dict]) -> set[int]:
    """Where each chunk of a stream ends: the tokens sent so far."""
    sent, ends = 0, set()
    for chunk in chunks:
        sent += len(chunk["choices"][0].get("token_ids") or [])
        ends.add(sent)
    return ends


def test_stream_interval_sends_the_first_token_then_chunks_of_that_many(server, model_dir):
    """A request's stream_interval (vLLM's): the first token at once, then 4 at a time, the rest
    at the end, adding up to the non-streamed reply; a server's --stream-interval is the default
    of requests that set none; 0 is a 400 naming the field. Chunks end only where the interval
    lets them: a reader that fell behind gets several as one (AsyncLLM folds them), so the
    test holds the chunks' ends to the interval's, not their number."""
    url = server[0]
    body = {"model": MODEL, "prompt": "The cat sat on", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=60).json()["choices"][0]
    chunks = stream_chunks(url, "/v1/completions", {**body, "stream_interval": 4})
    assert _ends(chunks) <= {1, 5, 9, 10} and max(_ends(chunks)) == 10
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_interval": 3}
    chunks = stream_chunks(url, "/v1/chat/completions", chat)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"  # the role opens
    assert _ends(chunks) <= {0, 1, 4, 7} and max(_ends(chunks)) == 7
    refused = httpx.post(url + "/v1/completions", json={**body, "stream_interval": 0}, headers=auth())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_interval"

    engine = make_llm(model_dir("llama"), max_num_seqs=4).llm_engine
    with running_server(engine, served_model_name=[MODEL], stream_interval=5) as (spaced_url, _):
        spaced = stream_chunks(spaced_url, "/v1/completions", body)
        assert _ends(spaced) <= {1, 6, 10} and max(_ends(spaced)) == 10
        own = stream_chunks(spaced_url, "/v1/completions", {**body, "stream_interval": 2})
        assert _ends(own) <= {1, 3, 5, 7, 9, 10} and max(_ends(own)) == 10  # the request's own, not 5


@pytest.mark.parametrize("text", ["plain", "h\u00e9llo \u4e16\u754c \U0001f600", "a\ud800b",
                                  "".join(map(chr, [10, 13, 11, 12, 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029]))])
def test_a_streamed_event_carries_any_text_as_json_on_one_line(text):
    """Events are written by msgspec; a lone surrogate, which UTF-8 cannot carry (a client may
    send one escaped in a stop string), goes out as JSON's escape instead of failing the stream,
    and every character ``str.splitlines`` breaks at is escaped (a random model writes them)."""
    event = sse({"choices": [{"text": text, "logprobs": None}], "created": 1})
    assert event.startswith("data: {") and event.endswith("\n\n")
    assert event[:-2].splitlines() == [event[:-2]]
    assert json.loads(event[len("data: "):]) == {"choices": [{"text": text, "logprobs": None}], "created": 1}


def test_stream_usage_chunk(client):
    """include_usage adds one final chunk with usage and no choices."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_shapes_n_and_indices(client):
    """String, string list, token ids and token-id lists; n fans out with OpenAI's indices."""
    single_ids = client.completions.create(model=MODEL, prompt=PROMPTS[1][:20], max_tokens=3, temperature=0)
    many = client.completions.create(model=MODEL, prompt=[PROMPTS[1][:20], PROMPTS[2][:20]], max_tokens=3,
                                     temperature=0)
    assert many.choices[0].text == single_ids.choices[0].text
    texts = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=4, n=2, temperature=1.0,
                                      seed=5)
    assert sorted(c.index for c in texts.choices) == [0, 1, 2, 3]
    assert texts.usage.completion_tokens == 16


def test_echo_with_logprobs_gives_prompt_logprobs(client):
    """echo + logprobs returns the prompt's tokens and logprobs first (lm-eval loglikelihood)."""
    response = client.completions.create(model=MODEL, prompt="The cat sat on the mat", max_tokens=1,
                                         temperature=0, echo=True, logprobs=1)
    choice = response.choices[0]
    assert choice.text.startswith("The cat sat on the mat")
    logprobs = choice.logprobs
    prompt_len = response.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_len + 1
    assert logprobs.token_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_and_top_logprobs(client):
    """logprobs=true with top_logprobs=3 gives each token with three ranked alternatives."""
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top


def test_vllm_sampling_extras_are_accepted(client):
    """top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority pass through."""
    response = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0.7, seed=1,
        extra_body=dict(top_k=5, min_p=0.05, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                        stop_token_ids=[3], priority=0, include_stop_str_in_output=False,
                        skip_special_tokens=True))
    assert len(response.choices[0].text) > 0


def test_seeded_requests_are_reproducible(client):
    """The same seed over HTTP gives the same sample."""
    kwargs = dict(model=MODEL, prompt="Rivers run", max_tokens=12, temperature=1.0, seed=42)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_models_tokenize_detokenize_health_version(server):
    """The auxiliary endpoints answer with their documented shapes."""
    url, _ = server
    models = httpx.get(url + "/v1/models", headers=auth()).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512
    tokens = httpx.post(url + "/tokenize", json={"prompt": "hello world"}, headers=auth()).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth()).json()
    assert text["prompt"] == "hello world"
    chat_tokens = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]},
                             headers=auth()).json()
    assert chat_tokens["count"] > 1
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(url + "/version").json()


def test_concurrent_greedy_requests_equal_sequential(aclient, client):
    """Greedy outputs of 12 concurrent requests equal the same requests sent one at a time."""
    prompts = [p[:30] for p in PROMPTS]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]

    async def all_at_once():
        responses = await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts])
        return [r.choices[0].text for r in responses]

    assert asyncio.run(all_at_once()) == alone


def test_120_concurrent_streams_all_complete_exactly_once(server):
    """120 concurrent SSE streams each end with [DONE], with no lost or duplicated tokens."""
    url, llm = server

    async def one(client: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        tokens, done = 0, False
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                         "logprobs": 0}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    import json
                    chunk = json.loads(line[6:])
                    tokens += len(chunk["choices"][0]["logprobs"]["tokens"])
        return done, tokens

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits, headers=auth()) as client:
            return await asyncio.gather(*[one(client, i) for i in range(120)])

    results = asyncio.run(run())
    assert all(done for done, _ in results)
    assert [tokens for _, tokens in results] == [6] * 120


def test_dropped_streams_free_their_blocks_and_the_server_keeps_serving(server, client):
    """20 clients that hang up mid-stream: running requests and KV usage return to idle within 2 s."""
    url, llm = server
    idle_usage = metric_values(url)["tokenmill:kv_cache_usage_perc"]

    async def drop(client: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": PROMPTS[i % 12][:40], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines >= 3:
                    break  # hang up mid-stream

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=auth()) as client:
            await asyncio.gather(*[drop(client, i) for i in range(20)])

    asyncio.run(run())
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        values = metric_values(url)
        if (llm.num_running == 0 and values["tokenmill:num_requests_running"] == 0
                and values["tokenmill:kv_cache_usage_perc"] <= idle_usage):
            break
        time.sleep(0.05)
    assert llm.num_running == 0 and llm.engine.scheduler.kv_cache.pool.usage() <= idle_usage
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).choices[0].text is not None


def test_metrics_parse_and_move(server, client):
    """/metrics parses with prometheus-client and its counters move as requests flow."""
    url, _ = server
    before = metric_values(url)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = metric_values(url)
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 5
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    key = "tokenmill:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    assert after["tokenmill:time_to_first_token_seconds_count"] > before["tokenmill:time_to_first_token_seconds_count"]
    assert after["tokenmill:e2e_request_latency_seconds_count"] > before["tokenmill:e2e_request_latency_seconds_count"]
    for name in ("tokenmill:num_requests_waiting", "tokenmill:num_preemptions_total",
                 "tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total",
                 "tokenmill:inter_token_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
                 "tokenmill:num_requests_swapped", "tokenmill:iteration_tokens_total_count"):
        assert name in after


def test_default_served_name_is_the_model_argument_as_given(model_dir):
    """vLLM's rule: with no served_model_name, clients send the model argument as given; the
    directory's own name is accepted as an alias, and responses report the first name."""
    path = model_dir("llama")
    engine = make_llm(path).llm_engine
    with running_server(engine) as (url, _):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [str(path), path.name]
        for name in (str(path), path.name):
            response = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200 and response.json()["model"] == str(path)
        assert httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404

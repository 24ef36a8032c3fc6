"""``tokenmill serve --engine-process``: the engine in a process of its own beside the HTTP
server (vLLM's engine core), over msgspec messages on a socket pair.

The served tokens and logprobs are Hugging Face's; a stream carries the same tokens; a
client that hangs up aborts its request in the other process; a request the engine refuses
fails alone; a call's errors reach its caller as the in-process engine raises them; a build
that fails says why; and neither process outlives the other (a dead engine ends the server
with status 1, a stopped server stops its engine). The device-fault tests run in both modes
too (test_device_faults.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from conftest import NEW_TOKENS, PROMPTS
from server_harness import serve_process
from test_cli import _children
from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.server.engine_core.messages import (
    Add,
    decode_from_core,
    decode_to_core,
    encode,
    Outputs,
    request_output,
    wire_output,
)
from tokenmill.testing.hf_reference import assert_matches_reference

logprob = st.builds(Logprob, st.floats(allow_nan=False, max_value=0), st.none() | st.integers(1, 20),
                    st.none() | st.text(max_size=4))
positions = st.lists(st.dictionaries(st.integers(0, 2**31 - 1), logprob, min_size=1, max_size=3), max_size=3)
completion = st.builds(CompletionOutput, st.integers(0, 7), st.text(max_size=8), st.lists(st.integers(0, 2**31 - 1)),
                       st.none() | st.floats(allow_nan=False), st.none() | positions,
                       st.sampled_from([None, "stop", "length", "abort", "error"]),
                       st.none() | st.integers(0, 99) | st.text(max_size=4))
metrics = st.builds(RequestMetrics, st.floats(0, 1e9), st.none() | st.floats(0, 1e9),
                    num_generation_tokens=st.integers(0, 2**40))


@settings(max_examples=200, deadline=None)
@given(request_id=st.text(max_size=12), prompt=st.none() | st.text(max_size=8),
       prompt_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=6),
       prompt_logprobs=st.none() | st.lists(st.none() | st.dictionaries(st.integers(0, 99), logprob, max_size=2)),
       outputs=st.lists(completion, max_size=3), finished=st.booleans(), first=st.booleans(),
       cached=st.integers(0, 2**20), request_metrics=metrics, error=st.none() | st.text(max_size=8))
def test_a_step_output_reads_back_as_it_was_sent(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs,
                                                 finished, first, cached, request_metrics, error):
    """Whatever text, token ids, logprobs and reasons a step's output holds cross the wire
    unchanged; the prompt travels with a request's first output only, metrics with its last."""
    sent = RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, cached,
                         request_metrics, error)
    message = decode_from_core(encode(Outputs([wire_output(sent, first)], 0, 1, 1)))
    wire = message.outputs[0]
    assert (wire.prompt_token_ids is not None) == first
    got = request_output(wire, prompt, prompt_token_ids)
    assert got == RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, cached,
                                request_metrics if finished else None, error)


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.sampled_from([-1, 1, 50]),
       seed=st.none() | st.integers(-2**63, 2**63 - 1), stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
       logit_bias=st.none() | st.dictionaries(st.integers(0, 99), st.floats(-100, 100), max_size=3),
       extra_args=st.none() | st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1) | st.text(max_size=5),
                                                        max_size=2),
       json_schema=st.none() | st.just({"type": "object"}), output_kind=st.integers(0, 2))
def test_sampling_params_arrive_as_they_were_sent(temperature, top_p, top_k, seed, stop, logit_bias, extra_args,
                                                  json_schema, output_kind):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                            logit_bias=logit_bias, extra_args=extra_args, output_kind=output_kind,
                            structured_outputs=None if json_schema is None else {"json": json_schema})
    add = Add("r", None, [1, 2], None, params, 0, None, 0.0, None)
    assert decode_to_core(encode(add)).params == params


def _token_ids(logprobs) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in logprobs.tokens]


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics").text
    return {f"{sample.name}{sample.labels.get('finished_reason', '')}": sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_an_engine_process_serves_hf_tokens_streams_aborts_and_stops_with_the_server(model_dir, hf_reference):
    flags = (str(model_dir("llama")), "--engine-process", "--served-model-name", "tiny", "--kv-cache-memory-bytes",
             "16MiB", "--return-tokens-as-token-ids", "--max-model-len", "256")
    with serve_process(*flags) as (process, base):
        engines = _children(process.pid)
        assert len(engines) == 1  # the engine core
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=[list(p) for p in PROMPTS], max_tokens=NEW_TOKENS,
                                               temperature=0, logprobs=0, extra_body={"ignore_eos": True})
        choices = sorted(completion.choices, key=lambda choice: choice.index)
        tokens = [_token_ids(choice.logprobs) for choice in choices]
        assert_matches_reference(hf_reference("llama"), tokens, [c.logprobs.token_logprobs for c in choices])
        assert completion.usage.prompt_tokens == sum(len(p) for p in PROMPTS)

        streamed = []
        for chunk in client.completions.create(model="tiny", prompt=list(PROMPTS[0]), max_tokens=NEW_TOKENS,
                                               temperature=0, logprobs=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            streamed += _token_ids(chunk.choices[0].logprobs)
        assert streamed == tokens[0]

        # a constraint compiles in both processes: here for the 400 before it travels, there off the step loop
        pattern = r"\d{3}-\d{4}"
        constrained = client.completions.create(model="tiny", prompt="Call", max_tokens=20, n=3, temperature=1.0,
                                                seed=1, extra_body={"structured_outputs": {"regex": pattern}})
        assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in constrained.choices)

        # JSON's integers have no bound, the wire's stop at 64 bits: a 400, and the server goes on
        refused = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Once", "max_tokens": 2, "vllm_xargs": {"x": 2**70}})
        assert refused.status_code == 400 and "engine process" in refused.json()["error"]["message"]

        # a client that hangs up: its request is aborted in the engine's process
        with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 30
        while (_metrics(base).get("tokenmill:request_success_totalabort", 0) < 1
               or _metrics(base)["tokenmill:num_requests_running"] != 0):
            assert time.monotonic() < deadline, "the aborted request is still running"
            time.sleep(0.1)
        assert _metrics(base)["tokenmill:generation_tokens_total"] >= NEW_TOKENS * (len(PROMPTS) + 1)
    assert process.returncode in (0, -15), process.stderr_text[-2000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in engines)


def test_a_config_only_the_engine_build_finds_wrong_exits_2_with_its_reason(model_dir):
    """The engine's build in its process finds the fault (here: a KV budget under one
    block, an encoder, which serves from one process); the server exits 2 and says why."""
    for model, flags, says in [(model_dir("llama"), ("--kv-cache-memory-bytes", "4KiB"), "cache.kv_cache_memory"),
                               (model_dir("bert"), (), "an embedding model is served from one process")]:
        result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--engine-process",
                                 *flags], capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert says in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_a_request_the_engine_refuses_fails_alone(model_dir):
    """The engine's own admission checks (here: an adapter it does not have, which the
    server's routes would have answered with a 404 first) fail that request's stream with
    the same error an in-process engine raises; the next request is served."""
    from tokenmill.server.engine_core.client import EngineCoreClient

    config = EngineConfig.model_validate(json.loads(json.dumps({
        "model": str(model_dir("llama")), "cache": {"kv_cache_memory": 16 * 2**20},
        "server": {"log_requests": False}})))
    client = EngineCoreClient(config, "tiny")

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        refused = client.generate("a", {"prompt": None, "prompt_token_ids": [5, 6, 7]}, params, adapter_name="nope")
        with pytest.raises(InvalidRequest) as raised:
            async for _ in refused:
                pass
        served = [output async for output in client.generate("b", {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                                                              params)]
        for request_id in ("c", "d"):  # closed after its first output, and before any
            stream = client.generate(request_id, {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                                     SamplingParams(max_tokens=200, ignore_eos=True))
            if request_id == "c":
                await anext(stream)
            await stream.aclose()
        await asyncio.sleep(1.0)  # the engine's outputs of both, sent before it read the aborts, arrive
        return raised.value, served

    try:
        error, served = asyncio.run(scenario())
    finally:
        client.shutdown(1.0)
    assert "nope" in str(error) and error.param is not None
    assert served[-1].finished and len(served[-1].outputs[0].token_ids) == 3
    assert served[-1].prompt_token_ids == [5, 6, 7]
    assert client.process.returncode == 0
    assert not client._prompts  # no prompt is kept for a request that ended
    # nor for one whose first output arrives after its stream closed (an abort racing the engine)
    late = RequestOutput("gone", None, [5, 6, 7], None, [CompletionOutput(0, "x", [8], None, None)], False)
    client._outputs(Outputs([wire_output(late, first=True)], 0, 0, 0))
    assert not client._prompts


def test_a_stop_signal_to_the_whole_process_group_lets_streams_finish(model_dir):
    """A terminal's Ctrl-C or a supervisor's SIGTERM reaches every process of the group: the
    engine process leaves its end to the server, whose drain lets a stream in flight finish."""
    import signal

    from server_harness import free_port, wait_until_healthy

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir("llama")), "--port",
                                str(port), "--engine-process", "--served-model-name", "tiny", "--kv-cache-memory-bytes",
                                "16MiB", "--max-model-len", "512"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until_healthy(port, process=process)
        engine = _children(process.pid)
        tokens, reasons = [], []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "logprobs": 0}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                tokens += choice["logprobs"]["tokens"]
                reasons.append(choice["finish_reason"])
                if len(reasons) == 1:
                    os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)  # the server ends on its own, its engine first
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=60)
    assert reasons[-1] == "length" and len(tokens) == 400, stderr[-2000:]
    assert "Application shutdown complete" in stderr and "the engine stopped" not in stderr
    assert not any(os.path.exists(f"/proc/{pid}") for pid in engine), stderr[-3000:]

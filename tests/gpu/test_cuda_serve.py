"""On a CUDA GPU: ``tokenmill serve --device cuda`` answers the ``openai`` client, streamed and
not, with the offline engine's greedy tokens, with the engine in the server's process, in its own
(--engine-process), or behind two API servers (--api-server-count 2, whose processes never touch the
GPU); a real illegal address in a step fails the
requests in flight, turns /health to 503 and ends the process with status 1 (a supervisor
restarts it); a real out-of-memory error fails its request and the server goes on."""

from __future__ import annotations

import openai
import pytest

from cuda_engines import GPU_SHARE, cuda_llm
from server_harness import serve_process
from test_device_faults import FAULTS, assert_a_device_fault_ends_the_server, assert_an_oom_fails_its_request_alone
from tokenmill import SamplingParams


def serving(model, *flags: str):
    return serve_process(str(model), "--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization",
                         str(GPU_SHARE), "--served-model-name", "m", *flags, timeout=180)


@pytest.mark.parametrize("mode", [(), ("--engine-process",), ("--api-server-count", "2")],
                         ids=["one-process", "engine-process", "api-servers"])
def test_serve_on_cuda_answers_the_openai_client_streamed_and_not(model_dir, mode):
    prompt = [5, 9, 33, 71, 2, 8, 13]
    offline = cuda_llm(model_dir("llama"), dtype="bfloat16").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    with serving(model_dir("llama"), *mode) as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert whole.choices[0].text == streamed == offline
    assert whole.usage.completion_tokens == 12 and chat.usage.completion_tokens <= 5


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_an_illegal_address_ends_the_server_after_failing_its_requests(model_dir, mode):
    with serving(model_dir("llama"), "--logits-processors", FAULTS, *mode) as (process, base):
        assert_a_device_fault_ends_the_server(process, base, "m")


def test_an_out_of_memory_step_fails_its_request_and_the_server_goes_on(model_dir):
    with serving(model_dir("llama"), "--logits-processors", FAULTS) as (_, base):
        assert_an_oom_fails_its_request_alone(base, "m")

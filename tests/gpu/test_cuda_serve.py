"""On a CUDA GPU: ``tokenmill serve --device cuda`` answers the ``openai`` client, streamed and
not, with the offline engine's greedy tokens; a real illegal address in a step fails the
requests in flight, turns /health to 503 and ends the process with status 1 (a supervisor
restarts it); a real out-of-memory error fails its request and the server goes on."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from cuda_engines import GPU_SHARE, cuda_llm
from server_harness import free_port
from test_cli import wait_until_healthy
from tokenmill import SamplingParams

FAULTS = "tokenmill.testing.device_faults:DeviceFault"


@contextmanager
def serving(model, *flags: str):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(port), "--device", "cuda",
         "--dtype", "bfloat16", "--gpu-memory-utilization", str(GPU_SHARE), "--served-model-name", "m", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port, timeout=180)
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.terminate()
        process.communicate(timeout=60)


def test_serve_on_cuda_answers_the_openai_client_streamed_and_not(model_dir):
    prompt = [5, 9, 33, 71, 2, 8, 13]
    offline = cuda_llm(model_dir("llama"), dtype="bfloat16").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    with serving(model_dir("llama")) as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert whole.choices[0].text == streamed == offline
    assert whole.usage.completion_tokens == 12 and chat.usage.completion_tokens <= 5


def test_an_illegal_address_ends_the_server_after_failing_its_requests(model_dir):
    with serving(model_dir("llama"), "--logits-processors", FAULTS) as (process, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        bystander: dict = {}

        def stream() -> None:
            try:
                for _ in client.completions.create(model="m", prompt="Once", max_tokens=4000, stream=True,
                                                   extra_body={"ignore_eos": True}):
                    pass
            except Exception as exc:  # noqa: BLE001 - the error is the result
                bystander["error"] = exc

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="m", prompt="Hi", max_tokens=3,
                                      extra_body={"vllm_xargs": {"device_fault": "illegal_address"}})
        thread.join(60)
        assert "device failed" in str(bystander.get("error", "")), bystander
        assert process.wait(timeout=60) == 1


def test_an_out_of_memory_step_fails_its_request_and_the_server_goes_on(model_dir):
    with serving(model_dir("llama"), "--logits-processors", FAULTS) as (_, base):
        failed = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": "Hi", "max_tokens": 3, "vllm_xargs": {"device_fault": "oom"}})
        assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 200
        served = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3},
                            timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3

"""What the engine and server do when the device breaks, on the CPU's stand-ins for the
GPU's errors (tokenmill.testing.device_faults; tests/gpu/test_cuda_faults.py raises the
real ones): a poisoned device stops the engine, fails every request in flight with the
reason, turns /health to 503 and ends ``tokenmill serve`` with a non-zero status, so that a
supervisor starts a fresh process; running out of memory fails that step's requests and
the engine goes on."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import make_llm
from server_harness import free_port
from test_cli import wait_until_healthy
from tokenmill import SamplingParams
from tokenmill.interfaces.errors import DeviceFailed

FAULTS = "tokenmill.testing.device_faults:DeviceFault"


def test_a_device_error_stops_the_engine_and_an_oom_fails_only_its_step(model_dir):
    llm = make_llm(model_dir("llama"), logits_processors=[FAULTS])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    oom = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args={"device_fault": "oom"})
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [oom, params], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error" and len(outputs[1].outputs[0].token_ids) == 4
    fatal = SamplingParams(temperature=0, max_tokens=4, extra_args={"device_fault": "illegal_address"})
    with pytest.raises(DeviceFailed, match="illegal memory access"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [fatal, params], use_tqdm=False)


def test_serve_exits_on_a_poisoned_device_after_failing_its_requests(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--served-model-name", "demo",
         "--kv-cache-memory-bytes", "16MiB", "--logits-processors", FAULTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        bystander: dict = {}

        def stream() -> None:  # a long request in flight when the device breaks
            try:
                for _ in client.completions.create(model="demo", prompt="Once", max_tokens=2000, stream=True,
                                                   extra_body={"ignore_eos": True}):
                    pass
            except Exception as exc:  # noqa: BLE001 - the error is the result
                bystander["error"] = exc

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="demo", prompt="Hi", max_tokens=3,
                                      extra_body={"vllm_xargs": {"device_fault": "illegal_address"}})
        assert refused.value.status_code in (500, 503)
        thread.join(30)
        assert "device failed" in str(bystander.get("error", "")), bystander
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=30)
    assert "the server exits so that a supervisor can restart it" in stderr


def test_an_oom_fails_its_request_and_the_server_goes_on(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--served-model-name", "demo",
         "--kv-cache-memory-bytes", "16MiB", "--logits-processors", FAULTS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(port)
        base = f"http://127.0.0.1:{port}"
        failed = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "Hi", "max_tokens": 3, "vllm_xargs": {"device_fault": "oom"}})
        assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 200
        served = httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 3},
                            timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.communicate(timeout=30)

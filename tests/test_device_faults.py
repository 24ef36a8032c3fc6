"""What the engine and server do when the device breaks, on the CPU's stand-ins for the
GPU's errors (tokenmill.testing.device_faults; tests/gpu/test_cuda_serve.py raises the real
ones through the same checks): a poisoned device stops the engine, fails every request in
flight with the reason, turns /health to 503 and ends ``tokenmill serve`` with a non-zero
status, so that a supervisor starts a fresh process; running out of memory fails that
step's requests and the engine goes on."""

from __future__ import annotations

import subprocess
import threading

import httpx
import openai
import pytest

from conftest import make_llm
from server_harness import serve_process
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


def test_a_device_fault_between_steps_stops_the_loop_and_no_call_waits_for_it(model_dir):
    """A call on the engine thread between steps (waking, loading weights) that breaks the
    device stops the loop as a step's fault does; the call queued behind it, and calls or
    pauses made afterwards, fail at once instead of awaiting a loop that is gone."""
    import asyncio

    import torch

    from tokenmill.core.engine.async_llm import AsyncLLM, EngineDead
    from tokenmill.testing.device_faults import illegal_address

    llm = AsyncLLM(make_llm(model_dir("llama")).llm_engine)

    async def scenario():
        fault = asyncio.ensure_future(llm.run_on_engine(lambda engine: illegal_address(torch.zeros(1))))
        queued = asyncio.ensure_future(llm.run_on_engine(lambda engine: "ran"))
        with pytest.raises(torch.AcceleratorError):
            await asyncio.wait_for(fault, 30)
        with pytest.raises(EngineDead, match="device failed"):
            await asyncio.wait_for(queued, 30)
        with pytest.raises(EngineDead, match="device failed"):
            await asyncio.wait_for(llm.run_on_engine(lambda engine: None), 5)
        with pytest.raises(EngineDead, match="device failed"):
            await asyncio.wait_for(llm.pause_generation(), 5)

    asyncio.run(scenario())
    assert isinstance(llm.error, DeviceFailed)


def test_a_device_fault_in_an_embedding_model_turns_health_to_503(model_dir, monkeypatch):
    """An embedding model's device error that poisons the device: that request gets a 503 that
    says why, /health turns 503 (``tokenmill serve`` exits on it, as for generation), and later
    requests fail with the same reason rather than touching the device again."""
    from server_harness import running_server
    from tokenmill import LLM
    from tokenmill.testing.device_faults import illegal_address

    engine = LLM(str(model_dir("bert"))).llm_engine
    encode = engine.model.encode

    def poisoned(input_ids, attention_mask):
        if input_ids.shape[1] > 6:  # a long input breaks the device
            illegal_address(input_ids)
        return encode(input_ids, attention_mask)

    monkeypatch.setattr(engine.model, "encode", poisoned)
    with running_server(engine, served_model_name=["bert"]) as (url, _):
        embed = lambda text: httpx.post(url + "/v1/embeddings", json={"model": "bert", "input": text}, timeout=60)
        assert embed("short").status_code == 200 and httpx.get(url + "/health").status_code == 200
        failed = embed("a much longer input that breaks the device")
        assert failed.status_code == 503 and "device failed" in failed.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        again = embed("short")
        assert again.status_code == 503 and "illegal memory access" in again.json()["error"]["message"]


def assert_a_device_fault_ends_the_server(process: subprocess.Popen, base: str, model: str) -> None:
    """A request in flight and the one that breaks the device both fail, and the process
    ends with status 1."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    bystander: dict = {}
    streaming = threading.Event()

    def stream() -> None:  # the rest of the context window: still going when the device breaks
        try:
            for _ in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Once"}],
                                                    stream=True, extra_body={"ignore_eos": True}):
                streaming.set()
        except Exception as exc:  # noqa: BLE001 - the error is the result
            bystander["error"] = exc
        streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(60) and "error" not in bystander
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=model, prompt="Hi", max_tokens=3,
                                  extra_body={"vllm_xargs": {"device_fault": "illegal_address"}})
    thread.join(60)
    assert "device failed" in str(bystander.get("error", "")), bystander
    assert process.wait(timeout=60) == 1


def assert_an_oom_fails_its_request_alone(base: str, model: str) -> None:
    failed = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hi", "max_tokens": 3, "vllm_xargs": {"device_fault": "oom"}})
    assert failed.status_code == 500 and "out of memory" in failed.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200
    served = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3},
                        timeout=60)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3


SERVE = ("--served-model-name", "demo", "--kv-cache-memory-bytes", "16MiB", "--logits-processors", FAULTS)


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_serve_exits_on_a_poisoned_device_after_failing_its_requests(mode):
    with serve_process(*SERVE, *mode) as (process, base):
        assert_a_device_fault_ends_the_server(process, base, "demo")
    assert "the server exits so that a supervisor can restart it" in process.stderr_text


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_an_oom_fails_its_request_and_the_server_goes_on(mode):
    with serve_process(*SERVE, *mode) as (_, base):
        assert_an_oom_fails_its_request_alone(base, "demo")

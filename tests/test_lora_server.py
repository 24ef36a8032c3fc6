"""LoRA over HTTP: adapters selected by the 'model' field, runtime load/unload, path confinement."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from conftest import PROMPTS
from server_harness import running_server
from tokenmill import LLM, LoRARequest, SamplingParams, load_config
from tokenmill.testing.tiny_adapters import make_lora_adapter


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    make_lora_adapter(model_dir("llama"), root / "qv", rank=4, targets=["q_proj", "v_proj"], seed=1)
    make_lora_adapter(model_dir("llama"), root / "mlp", rank=8, targets=["gate_proj", "up_proj", "down_proj"], seed=2)
    return root


@pytest.fixture(scope="module")
def server(model_dir, adapter_root):
    config = load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**25, enable_lora=True, max_loras=2,
                         max_lora_rank=8, lora_modules={"qv": str(adapter_root / "qv")},
                         allowed_lora_dirs=[str(adapter_root)], allow_runtime_lora_updating=True)
    engine = LLM(config=config).llm_engine
    with running_server(engine, served_model_name=["base"]) as (url, _):
        yield url


def complete(url, model, stream=False, prompt=None):
    body = {"model": model, "prompt": prompt or PROMPTS[0][:30], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=60)
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_models_list_adapters_with_their_parent(server):
    """/v1/models shows the base model and each adapter, whose parent is the base."""
    data = {m["id"]: m for m in httpx.get(server + "/v1/models").json()["data"]}
    assert data["base"]["parent"] is None and data["qv"]["parent"] == "base"


def test_adapter_selected_by_model_field_matches_offline(server, model_dir, adapter_root):
    """model='qv' answers with the adapter, streamed and not, equal to offline LoRA generation."""
    llm = LLM(str(model_dir("llama")), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=2**24)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = llm.generate({"prompt_token_ids": PROMPTS[0][:30]}, params, use_tqdm=False,
                           lora_request=LoRARequest("qv", 1, str(adapter_root / "qv")))[0].outputs[0].text
    base = complete(server, "base").json()["choices"][0]["text"]
    with_adapter = complete(server, "qv").json()["choices"][0]["text"]
    assert with_adapter == offline != base
    assert complete(server, "qv", stream=True) == with_adapter


def test_runtime_load_use_and_unload(server):
    """An adapter loaded at run time serves requests; once unloaded its name is unknown again."""
    assert complete(server, "mlp").status_code == 404
    loaded = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": "mlp"})
    assert loaded.status_code == 200, loaded.text
    assert complete(server, "mlp").status_code == 200
    assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    assert complete(server, "mlp").status_code == 404
    assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 400


@pytest.mark.parametrize("path", ["../outside", "/etc", "qv/../../elsewhere", "link-out", "missing"])
def test_paths_outside_the_allowed_dirs_are_refused(server, adapter_root, tmp_path_factory, path):
    """'..', absolute paths elsewhere, symlinks pointing out and missing dirs get a 400."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "adapter_config.json").write_text("{}")
    link = adapter_root / "link-out"
    if not link.exists():
        os.symlink(outside, link)
    response = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": path})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora_path"


def test_runtime_updates_are_off_by_default(model_dir, adapter_root):
    """Without allow_runtime_lora_updating the load endpoint does not exist."""
    engine = LLM(str(model_dir("llama")), enable_lora=True, kv_cache_memory_bytes=2**24).llm_engine
    with running_server(engine) as (url, _):
        response = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "qv"})
    assert response.status_code == 404


def test_loading_an_adapter_does_not_disturb_running_requests(server):
    """A long stream on the base model gives the same text while an adapter loads and unloads mid-way."""
    import threading

    prompt = PROMPTS[3][:20]
    body = {"model": "base", "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    text, started = "", threading.Event()

    def churn():
        started.wait(30)
        for _ in range(3):
            assert httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "churn", "lora_path": "mlp"}).status_code == 200
            assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "churn"}).status_code == 200

    worker = threading.Thread(target=churn)
    worker.start()
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                started.set()
    worker.join(30)
    assert text == expected

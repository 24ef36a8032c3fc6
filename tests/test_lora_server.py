"""LoRA over HTTP: adapters selected by the 'model' field, runtime load/unload, path
confinement; with the engine on the server's thread and in its own process (--engine-process),
where loads and unloads cross the socket as named calls."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from conftest import PROMPTS
from server_harness import ENGINE_MODES, running_server, served_engine
from tokenmill import LLM, LoRARequest, SamplingParams, load_config
from tokenmill.testing.tiny_adapters import make_lora_adapter


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    make_lora_adapter(model_dir("llama"), root / "qv", rank=4, targets=["q_proj", "v_proj"], seed=1)
    make_lora_adapter(model_dir("llama"), root / "mlp", rank=8, targets=["gate_proj", "up_proj", "down_proj"], seed=2)
    return root


@pytest.fixture(scope="module", params=ENGINE_MODES)
def server(model_dir, adapter_root, request):
    with served_engine(request.param, str(model_dir("llama")), kv_cache_memory_bytes=2**25, enable_lora=True,
                       max_loras=2, max_lora_rank=8, lora_modules={"qv": str(adapter_root / "qv")},
                       allowed_lora_dirs=[str(adapter_root)], allow_runtime_lora_updating=True) as engine:
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


def _broken_adapters(root, good):
    """Adapter directories that are each wrong in one way, made from the good one."""
    import shutil

    from safetensors.torch import load_file, save_file

    def copy(name):
        target = root / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(good, target)
        return target

    weights = good / "adapter_model.safetensors"
    data = weights.read_bytes()
    (copy("truncated") / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    (copy("corrupt-header") / "adapter_model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{garbage")
    tensors = load_file(weights)
    save_file({k: v[:, :-1].contiguous() if ".lora_A." in k else v for k, v in tensors.items()},
              copy("wrong-shapes") / "adapter_model.safetensors")
    renamed = {k.replace("q_proj", "no_such_proj"): v for k, v in tensors.items()}
    save_file(renamed, copy("unknown-module") / "adapter_model.safetensors")
    (copy("no-config") / "adapter_config.json").unlink()
    (copy("bad-config") / "adapter_config.json").write_text('{"r": "four"')
    (copy("config-not-object") / "adapter_config.json").write_text('[1, 2]')


@pytest.mark.parametrize("name,path,param,says", [
    ("t", "truncated", "lora_path", "cannot be read"),
    ("c", "corrupt-header", "lora_path", "cannot be read"),
    ("w", "wrong-shapes", "lora_path", "where the layer takes"),
    ("u", "unknown-module", "lora_path", "no_such_proj"),
    ("n", "no-config", "lora_path", "not a PEFT adapter directory"),
    ("b", "bad-config", "lora_path", "adapter_config.json"),
    ("o", "config-not-object", "lora_path", "adapter_config.json"),
    ("base", "mlp", "lora_name", "served model"),  # the served model's own name
    ("qv", "mlp", "lora_name", "already loaded"),  # a loaded adapter's name: unload first
])
def test_adapter_loads_that_fail_are_400s_that_change_nothing(server, adapter_root, name, path, param, says):
    _broken_adapters(adapter_root, adapter_root / "qv")
    base, with_adapter = complete(server, "base").json(), complete(server, "qv").json()
    response = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert name not in {m["id"] for m in httpx.get(server + "/v1/models").json()["data"]} - {"base", "qv"}
    assert complete(server, "base").json()["choices"] == base["choices"]
    assert complete(server, "qv").json()["choices"] == with_adapter["choices"]


def _pickle_trap(path, sentinel):
    """A file that creates ``sentinel`` if anything ever unpickles it."""
    import pickle

    class Trap:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    path.write_bytes(pickle.dumps(Trap()))


def test_pickled_weights_are_never_unpickled(model_dir, adapter_root, tmp_path):
    """adapter_model.bin / pytorch_model.bin beside (or instead of) safetensors files: at
    startup and at run time, nothing opens them."""
    import shutil

    sentinel = tmp_path / "unpickled"
    pickled = adapter_root / "pickled"
    pickled.mkdir(exist_ok=True)
    shutil.copy(adapter_root / "qv" / "adapter_config.json", pickled)
    for name in ("adapter_model.bin", "pytorch_model.bin"):
        _pickle_trap(pickled / name, sentinel)
    model = tmp_path / "model"
    shutil.copytree(model_dir("llama"), model)
    _pickle_trap(model / "pytorch_model.bin", sentinel)
    with pytest.raises(Exception, match="adapter_model.safetensors"):  # at startup
        LLM(str(model), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=2**24,
            lora_modules={"pickled": str(pickled)})
    config = load_config(model=str(model), kv_cache_memory_bytes=2**24, enable_lora=True, max_lora_rank=8,
                         allowed_lora_dirs=[str(adapter_root)], allow_runtime_lora_updating=True)
    with running_server(LLM(config=config).llm_engine) as (url, _):  # the model's own .bin is ignored
        response = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": "pickled"})
        assert response.status_code == 400 and "adapter_model.safetensors" in response.json()["error"]["message"]
    assert not sentinel.exists()

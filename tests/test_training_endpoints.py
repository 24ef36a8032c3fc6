"""The training-loop endpoints on a real server (vLLM 0.32's names): off by default, behind
the API key, and each one's effect observed: pause modes on running and arriving requests,
the weight-transfer cycle from a trainer over gloo, sleep and wake, the prefix cache's
reset, worker RPCs. Each runs with the engine on the server's thread and in its own process
(--engine-process), where every call crosses the socket by name."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import make_llm
from server_harness import ENGINE_MODES, free_port, running_server, served_engine
from test_weight_transfer import hf_greedy, perturbed
from tokenmill.weight_transfer import GLOOTrainerSendWeightsArgs, GLOOWeightTransferEngine

KEY = "training-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", params=ENGINE_MODES)
def served(model_dir, request):
    with served_engine(request.param, str(model_dir("llama")), dtype="float32", enable_sleep_mode=True,
                       kv_cache_memory_bytes=32 * 2**20, weight_transfer_config={"backend": "gloo"}) as engine:
        with running_server(engine, served_model_name=["m"], api_key=KEY,
                            enable_training_endpoints=True) as (base, llm):
            yield base, llm


def post(base: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(base + path, headers=AUTH, timeout=60, **kwargs)


def complete(base: str, max_tokens: int = 4, **extra) -> httpx.Response:
    return post(base, "/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True, **extra})


def test_the_endpoints_are_off_by_default(model_dir):
    with running_server(make_llm(model_dir("llama")).llm_engine, served_model_name=["m"]) as (base, _):
        assert httpx.post(base + "/pause").status_code == 404
        assert httpx.post(base + "/sleep").status_code == 404
        assert "/pause" not in httpx.get(base + "/openapi.json").json()["paths"]


def test_they_need_the_api_key_and_appear_in_the_schema(served):
    base, _ = served
    assert httpx.post(base + "/pause").status_code == 401
    assert httpx.get(base + "/is_paused").status_code == 401
    paths = httpx.get(base + "/openapi.json").json()["paths"]
    assert {"/pause", "/resume", "/is_paused", "/init_weight_transfer_engine", "/start_weight_update",
            "/update_weights", "/finish_weight_update", "/weight_info", "/get_world_size", "/sleep", "/wake_up",
            "/is_sleeping", "/reset_prefix_cache", "/collective_rpc"} <= set(paths)


def _in_background(call):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("response", call()), daemon=True)
    thread.start()
    return thread, result


def _paused_while_running(base, llm, mode: str, max_tokens: int):
    """A request running in the background, and the server paused under it in ``mode``."""
    thread, running = _in_background(lambda: complete(base, max_tokens=max_tokens))
    while not llm.num_running:
        time.sleep(0.01)
    assert post(base, "/pause", params={"mode": mode}).status_code == 200
    return thread, running


def test_pause_modes(served):
    base, llm = served
    # abort: the running request ends with finish_reason "abort"; one arriving meanwhile waits
    thread, running = _paused_while_running(base, llm, "abort", 400)
    thread.join(30)
    assert running["response"].json()["choices"][0]["finish_reason"] == "abort"
    assert httpx.get(base + "/is_paused", headers=AUTH).json() == {"is_paused": True}
    waiting_thread, waiting = _in_background(lambda: complete(base))
    time.sleep(1.0)
    assert waiting_thread.is_alive()  # held, not refused
    assert post(base, "/resume").status_code == 200
    waiting_thread.join(30)
    assert waiting["response"].status_code == 200 and len(waiting["response"].json()["choices"][0]["text"]) > 0
    # wait: the running request finishes whole first
    thread, running = _paused_while_running(base, llm, "wait", 60)
    thread.join(30)
    assert running["response"].json()["choices"][0]["finish_reason"] == "length"
    post(base, "/resume")
    # keep: the running request is frozen, then finishes whole after resume
    thread, running = _paused_while_running(base, llm, "keep", 400)
    time.sleep(0.5)
    assert thread.is_alive()
    post(base, "/resume")
    thread.join(60)
    assert running["response"].json()["usage"]["completion_tokens"] == 400
    assert post(base, "/pause", params={"mode": "sideways"}).status_code == 400


def test_a_pause_while_paused_is_answered_at_once(served):
    """A request frozen by a "keep" pause cannot finish, so a "wait" pause then has nothing
    to wait for: it is answered at once, and after resume the request runs to its end."""
    base, llm = served
    thread, running = _paused_while_running(base, llm, "keep", 400)
    waiting_pause, answer = _in_background(lambda: post(base, "/pause", params={"mode": "wait"}))
    waiting_pause.join(30)
    assert answer["response"].status_code == 200 and thread.is_alive()
    assert post(base, "/resume").status_code == 200
    thread.join(60)
    assert running["response"].json()["usage"]["completion_tokens"] == 400
    assert httpx.get(base + "/is_paused", headers=AUTH).json() == {"is_paused": False}


def test_weight_transfer_cycle_from_a_trainer(served, model_dir):
    """A trainer (a thread here, with its own gloo group) pushes new weights through the
    endpoints; the server then answers with them, as transformers does."""
    base, _ = served
    path = model_dir("llama")
    weights = perturbed(path, seed=7)
    port = free_port()
    init_info = dict(master_address="127.0.0.1", master_port=port, world_size=2, authkey="cd" * 16)
    group = {}
    trainer = threading.Thread(target=lambda: group.setdefault("g", GLOOWeightTransferEngine.trainer_init(init_info)))
    trainer.start()
    assert post(base, "/init_weight_transfer_engine", json={"init_info": {**init_info, "rank_offset": 1}}).status_code \
        == 200
    trainer.join(30)
    assert post(base, "/start_weight_update").status_code == 200
    sender = threading.Thread(target=lambda: GLOOWeightTransferEngine.trainer_send_weights(
        iter(weights.items()), GLOOTrainerSendWeightsArgs(group=group["g"])))
    sender.start()
    update = {"names": list(weights), "dtype_names": ["float32"] * len(weights),
              "shapes": [list(t.shape) for t in weights.values()]}
    assert post(base, "/update_weights", json={"update_info": update}).status_code == 200
    sender.join(30)
    assert post(base, "/finish_weight_update", json={"weight_version": "v7"}).status_code == 200
    assert httpx.get(base + "/weight_info", headers=AUTH).json() == {"weight_version": "v7"}
    expected, _ = hf_greedy(path, weights, [5, 6, 7, 8], 4)
    reply = complete(base, return_token_ids=True)
    assert reply.json()["choices"][0]["token_ids"] == expected
    bad = post(base, "/update_weights", json={"update_info": {**update, "names": ["nope"] + update["names"][1:]}})
    assert bad.status_code == 400 and "no such weights in this model: nope" in bad.json()["error"]["message"]
    assert post(base, "/update_weights", json={"update_info": {"weights": {}}}).status_code == 400
    assert httpx.get(base + "/get_world_size", headers=AUTH).json() == {"world_size": 1}


def test_sleep_wake_and_the_prefix_cache(served):
    base, _ = served
    before = complete(base).json()["choices"][0]["text"]
    assert post(base, "/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(base + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    asleep = complete(base)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    assert post(base, "/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert httpx.get(base + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert complete(base).json()["choices"][0]["text"] == before
    assert post(base, "/reset_prefix_cache").json() == {"reset": True}
    assert post(base, "/sleep", params={"level": 3}).status_code == 400


def test_collective_rpc_endpoint(served):
    base, _ = served
    answer = post(base, "/collective_rpc", json={"method": "rank_info"}).json()
    assert [r["rank"] for r in answer["results"]] == [0]
    failed = post(base, "/collective_rpc", json={"method": "fail_on_rank", "args": [0, "no"]})
    assert failed.status_code == 400 and "rank 0: RuntimeError: no" in failed.json()["error"]["message"]

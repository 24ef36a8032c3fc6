"""A multi-process engine never hangs and never leaves processes behind: a worker that dies
or hangs fails the requests in flight and the health check, within seconds."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from conftest import make_llm
from server_harness import running_server
from tokenmill import LLM, SamplingParams
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.errors import ConfigError, WorkerFailed
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention

MODEL = "tiny"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def worker_pids(engine) -> list[int]:
    return [hello.pid for hello in engine.workers.hellos.values()]


def test_killed_worker_fails_the_stream_and_health_and_leaves_nothing(model_dir):
    engine = make_llm(model_dir("llama"), tensor_parallel_size=2).llm_engine
    [pid] = worker_pids(engine)
    with running_server(engine, served_model_name=[MODEL], drain_timeout=0) as (base, llm):
        assert httpx.get(base + "/health").status_code == 200
        body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines, killed_at = [], None
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                if len(lines) == 3:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert time.monotonic() - killed_at < 10
        assert lines[-1] == "data: [DONE]" and "event: error" in lines
        error = json.loads(lines[lines.index("event: error") + 1][6:])["error"]
        assert "rank" in error["message"]
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and "WorkerFailed" in health.json()["detail"]
        # a new request is refused at once, not queued behind a dead engine
        assert httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=10).status_code == 503
    assert not alive(pid)


def test_idle_engine_notices_a_dead_worker(model_dir):
    engine = make_llm(model_dir("llama"), pipeline_parallel_size=2).llm_engine
    [pid] = worker_pids(engine)
    with running_server(engine, served_model_name=[MODEL]) as (base, _):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still ok 10 s after the worker died"
            time.sleep(0.2)


def test_hung_worker_times_out_instead_of_hanging(model_dir):
    """A stopped worker holds a collective: the step fails after distributed_timeout_seconds."""
    llm = make_llm(model_dir("llama"), tensor_parallel_size=2, distributed_timeout_seconds=3)
    [pid] = worker_pids(llm.llm_engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [7, 8, 9]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerFailed):
            llm.generate({"prompt_token_ids": [7, 8, 9]}, params, use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()  # kills the stopped worker
    assert not alive(pid)


def test_shutdown_stops_every_worker(model_dir):
    llm = make_llm(model_dir("llama"), tensor_parallel_size=2)
    pids = worker_pids(llm.llm_engine)
    assert all(alive(p) for p in pids)
    llm.shutdown()
    llm.shutdown()  # twice is harmless
    assert not any(alive(p) for p in pids)


class _DriverOnly:
    """A component registered in this process only, as a notebook or a test would."""

    @hookimpl
    def register_attention_backends(self, register):
        register("driver_only", TorchReferenceAttention)


def test_component_registered_only_in_the_driver_fails_at_startup(model_dir):
    pm = make_plugin_manager()
    pm.register(_DriverOnly(), name="driver-only")
    before = set(os.listdir("/proc"))
    with pytest.raises(ConfigError, match="registered only in the driver: driver_only=") as info:
        LLM(str(model_dir("llama")), tensor_parallel_size=2, plugin_manager=pm, kv_cache_memory_bytes=2**24)
    assert "entry point" in str(info.value)
    leftovers = [int(p) for p in set(os.listdir("/proc")) - before if p.isdigit() and alive(int(p))]
    assert not [p for p in leftovers if b"tokenmill.core.distributed.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_uni_executor_refuses_more_than_one_rank(model_dir):
    with pytest.raises(ConfigError, match="'uni' runs one rank"):
        make_llm(model_dir("llama"), tensor_parallel_size=2, distributed_executor_backend="uni")


def test_shapes_that_cannot_be_split_fail_at_startup_naming_the_flag(model_dir):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        make_llm(model_dir("llama"), tensor_parallel_size=3)  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        make_llm(model_dir("gpt2"), pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="embedding model"):
        LLM(str(model_dir("bert")), tensor_parallel_size=2)

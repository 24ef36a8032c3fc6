"""``tokenmill serve --api-server-count N``: N HTTP server processes on one port in front of
one engine-core process (vLLM's flag).

Each server serves Hugging Face's tokens; the kernel spreads connections across them; what
one server's caller changes (a pause, a LoRA adapter) is what every server reads; a stop
signal drains them all and leaves no process behind; a server that dies takes the others
down (status 1, for a supervisor to restart), and so does a parent killed outright; a port
in use, or an engine build that fails, is a clear exit 2.

A connection's server is found from /proc: the server-side socket of the connection from
the client's port, and the process holding it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import NEW_TOKENS, PROMPTS
from server_harness import free_port, serve_process, wait_until_healthy
from test_cli import _children
from tokenmill.testing.hf_reference import assert_matches_reference
from tokenmill.testing.tiny_adapters import make_lora_adapter

FLAGS = ("--api-server-count", "2", "--served-model-name", "tiny", "--kv-cache-memory-bytes", "16MiB",
         "--max-model-len", "256", "--return-tokens-as-token-ids")


def _socket_inode(port: int, client_port: int) -> int | None:
    """The inode of the server's end of the established connection from ``client_port``."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
        if state == "01" and int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            return inode
    return None


def _holder(inode: int, pids: list[int]) -> int | None:
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


def _request(connection: http.client.HTTPConnection, method: str, path: str, body: dict | None = None):
    connection.request(method, path, body=None if body is None else json.dumps(body),
                       headers={"content-type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"null")


def connection_per_server(port: int, servers: list[int]) -> dict[int, http.client.HTTPConnection]:
    """A kept-alive connection to each server process: new connections until every server
    holds one (the kernel picks by the connection's addresses, among the servers listening
    already: the port is healthy once one of them is). Fails if some server is never picked
    within a minute."""
    found: dict[int, http.client.HTTPConnection] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        assert _request(connection, "GET", "/health")[0] == 200  # accepted: a server holds it now
        holder = _holder(_socket_inode(port, connection.sock.getsockname()[1]), servers)
        if holder is not None and holder not in found:
            found[holder] = connection
        else:
            connection.close()
        if len(found) == len(servers):
            return found
    raise AssertionError(f"connections reached only {sorted(found)} of the servers {servers}")


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    make_lora_adapter(model_dir("llama"), root / "mlp", rank=8, targets=["gate_proj", "up_proj", "down_proj"], seed=2)
    return root


@pytest.fixture(scope="module")
def served(model_dir, adapter_root):
    """(process, port, the server pids) of two API servers with LoRA and the training
    endpoints on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_ADAPTERS__ALLOW_RUNTIME_LORA_UPDATING", "true")
        with serve_process(str(model_dir("llama")), *FLAGS, "--enable-training-endpoints", "--enable-lora",
                           "--max-lora-rank", "8", "--allowed-lora-dirs", str(adapter_root)) as (process, base):
            port = int(base.rsplit(":", 1)[1])
            children = _children(process.pid)
            assert len(children) == 3  # the engine core and two servers
            yield process, port, [pid for pid in children
                                  if "api_server_process" in Path(f"/proc/{pid}/cmdline").read_text()]


def test_every_server_serves_hf_tokens(served, hf_reference):
    connections = connection_per_server(*served[1:])
    for connection in connections.values():
        status, completion = _request(connection, "POST", "/v1/completions", {
            "model": "tiny", "prompt": [list(p) for p in PROMPTS], "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": 0, "ignore_eos": True})
        assert status == 200, completion
        choices = sorted(completion["choices"], key=lambda choice: choice["index"])
        tokens = [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]
        assert_matches_reference(hf_reference("llama"), tokens, [c["logprobs"]["token_logprobs"] for c in choices])


def test_a_pause_or_an_adapter_asked_of_one_server_is_what_every_server_reads(served):
    first, second = connection_per_server(*served[1:]).values()
    assert _request(first, "POST", "/pause?mode=keep")[0] == 200
    assert _request(second, "GET", "/is_paused")[1] == {"is_paused": True}
    assert _request(second, "POST", "/resume")[0] == 200
    assert _request(first, "GET", "/is_paused")[1] == {"is_paused": False}

    assert _request(first, "POST", "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": "mlp"})[0] == 200
    assert "mlp" in [model["id"] for model in _request(second, "GET", "/v1/models")[1]["data"]]
    status, completion = _request(second, "POST", "/v1/completions", {"model": "mlp", "prompt": "Once",
                                                                       "max_tokens": 4})
    assert status == 200 and completion["model"] == "mlp"
    assert _request(second, "POST", "/v1/unload_lora_adapter", {"lora_name": "mlp"})[0] == 200
    assert _request(first, "POST", "/v1/completions", {"model": "mlp", "prompt": "Once", "max_tokens": 4})[0] == 404


def test_a_stream_closed_early_on_either_server_ends_its_request_alone(served):
    """Each server's client hangs up mid-stream: the engine aborts those two requests, and a
    request on the other server meanwhile runs to its end."""
    first, second = connection_per_server(*served[1:]).values()
    body = json.dumps({"model": "tiny", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True})
    for connection in (first, second):
        connection.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
    for connection in (first, second):
        connection.close()  # hangs up
    port = served[1]
    fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    status, completion = _request(fresh, "POST", "/v1/completions", {"model": "tiny", "prompt": "Once",
                                                                      "max_tokens": 40, "ignore_eos": True})
    assert status == 200 and completion["usage"]["completion_tokens"] == 40
    deadline = time.monotonic() + 30
    while True:
        fresh.request("GET", "/metrics")
        text = fresh.getresponse().read().decode()
        running = [line for line in text.splitlines() if line.startswith("tokenmill:num_requests_running")]
        aborted = [line for line in text.splitlines()
                   if line.startswith("tokenmill:request_success_total") and 'finished_reason="abort"' in line]
        if running and float(running[0].split()[-1]) == 0 and aborted and float(aborted[0].split()[-1]) >= 2:
            break
        assert time.monotonic() < deadline, (running, aborted)
        time.sleep(0.1)
    fresh.close()


def _start(model_dir, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir("llama")), "--port",
                                str(port), *FLAGS, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    wait_until_healthy(port, process=process)
    return process, port


def _gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_stop_signal_to_the_group_drains_every_server_and_leaves_no_process(model_dir):
    """As a terminal's Ctrl-C reaches a process group: a stream in flight finishes, status 0."""
    process, port = _start(model_dir)
    children = _children(process.pid)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps({
            "model": "tiny", "prompt": "Once", "max_tokens": 240, "ignore_eos": True, "stream": True}),
            headers={"content-type": "application/json"})
        response = connection.getresponse()
        lines = [response.readline()]
        os.killpg(process.pid, signal.SIGINT)
        lines += response.read().split(b"\n")
        _, stderr = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=60)
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", stderr[-3000:]
    assert process.returncode == 0, stderr[-3000:]
    assert _gone(children), stderr[-3000:]


def test_a_server_that_dies_takes_the_others_down_with_status_1(model_dir):
    process, _ = _start(model_dir)
    children = _children(process.pid)
    try:
        server = next(pid for pid in children if "api_server_process" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(server, signal.SIGKILL)
        _, stderr = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=60)
    assert process.returncode == 1 and "a server process exited" in stderr, stderr[-3000:]
    assert _gone(children), stderr[-3000:]


def test_a_parent_killed_outright_leaves_no_server_or_engine_behind(model_dir):
    process, _ = _start(model_dir)
    children = _children(process.pid)
    process.kill()
    process.communicate(timeout=60)
    try:
        assert _gone(children)
    finally:
        for pid in children:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)


def test_a_port_in_use_or_a_failed_build_exits_2_and_says_why_once(model_dir):
    def serve(port: int, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir("llama")), "--host",
                               "127.0.0.1", "--port", str(port), *FLAGS, *flags], capture_output=True, text=True,
                              timeout=120)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(port)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr

    result = serve(free_port(), "--kv-cache-memory-bytes", "4KiB")  # every server hears the engine's failure
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("tokenmill: error: cache.kv_cache_memory") == 1 and "Traceback" not in result.stderr

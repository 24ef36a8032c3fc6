"""The engine core with two API servers' connections, in this process: each server hears its
own requests' outputs and its own calls' answers, an abort reaches only the sender's own
request, and a server that leaves takes only its requests with it."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Connection

from tokenmill.core.config.engine_config import EngineConfig
from tokenmill.core.engine.builder import build_engine
from tokenmill.core.engine.metrics import EngineMetrics
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.server.engine_core.core_process import EngineCore
from tokenmill.server.engine_core.messages import (
    Abort,
    Add,
    Call,
    CallDone,
    Outputs,
    Shutdown,
    decode_from_core,
    encode,
)


def _add(request_id: str, tokens: int) -> Add:
    return Add(request_id, None, [5, 6, 7], None, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
               0, None, 0.0, None)


def _until_finished(connection: Connection, request_ids: set[str]) -> dict[str, list]:
    """Each request's outputs as this server hears them, until all of ``request_ids`` end."""
    heard: dict[str, list] = {}
    while not request_ids <= {rid for rid, outputs in heard.items() if outputs[-1].finished}:
        assert connection.poll(60), heard
        message = decode_from_core(connection.recv_bytes())
        if isinstance(message, Outputs):
            for output in message.outputs:
                heard.setdefault(output.request_id, []).append(output)
    return heard


def test_each_server_hears_its_own_requests_and_ends_only_its_own(model_dir):
    engine = build_engine(EngineConfig.model_validate({"model": str(model_dir("llama")),
                                                      "cache": {"kv_cache_memory": 16 * 2**20}}))
    pairs = [socket.socketpair() for _ in range(2)]
    servers = [Connection(ours.detach()) for ours, _ in pairs]
    core = EngineCore(engine, [Connection(theirs.detach()) for _, theirs in pairs], EngineMetrics("m"), False)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    first, second = servers
    try:
        first.send_bytes(encode(_add("a", 6)))
        second.send_bytes(encode(_add("b", 400)))
        second.send_bytes(encode(Abort("a")))  # not the second server's request: ignored
        first.send_bytes(encode(Abort("b")))
        first.send_bytes(encode(Call(0, "is_sleeping", {})))
        second.send_bytes(encode(Call(0, "is_sleeping", {})))
        heard_first = _until_finished(first, {"a"})
        assert set(heard_first) == {"a"} and heard_first["a"][-1].outputs[0].finish_reason == "length"
        assert len(heard_first["a"][-1].outputs[0].token_ids) == 6  # cumulative outputs: the last holds all
        # the second server's request goes on; then it leaves, and its request ends with it: the
        # core closes its connection once it has let go of the server's requests
        second.send_bytes(encode(Shutdown()))
        answers = []
        while True:
            assert second.poll(60)
            try:
                message = decode_from_core(second.recv_bytes())
            except EOFError:
                break
            if isinstance(message, CallDone):
                answers.append(message)
            elif isinstance(message, Outputs):  # b's, never its last: b ends because its server left
                assert all(output.request_id == "b" and not output.finished for output in message.outputs)
        # each server heard its own call's answer (call ids are per server: both were 0)
        assert [answer.call_id for answer in answers] == [0] and answers[0].result is False
        assert loop.is_alive() and "b" not in core._owner
        first.send_bytes(encode(_add("c", 3)))
        assert set(_until_finished(first, {"c"})) == {"c"}
    finally:
        first.send_bytes(encode(Shutdown()))
        loop.join(30)
    assert not loop.is_alive()

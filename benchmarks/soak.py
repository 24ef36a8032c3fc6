"""Soak: thousands of mixed requests at high concurrency against one server, then the invariants.

The mix (seeded): plain and streamed completions, streamed chat, ``n > 1``, prompts near the
context window, streams the client abandons after a few chunks, requests cancelled while they
wait, and requests the server must refuse with a 4xx. Each request carries its own
``request_id``, which the response echoes: a request without a complete response is lost,
and a response that finishes one of its sequences twice is duplicated.

Reports the server's RSS at start (after a first warm-up wave), middle and end, KV-cache blocks in use and requests still
running after the run (both must be 0), lost and duplicated responses (both must be 0), and
requests per second.

    python benchmarks/soak.py --preset tiny --num-requests 5000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

from tokenmill.bench.common import add_common_args, prepare, process_rss_mib, wait_ready, write_json

KINDS = ("complete", "stream", "chat_stream", "n_best", "long", "abandon", "cancel", "reject")


@dataclass
class Tally:
    """What came back, per request id, and what the run saw of the server."""

    completed: Counter = field(default_factory=Counter)  # ids whose full response arrived
    duplicated: int = 0  # responses that finished a sequence more than once
    rejected: Counter = field(default_factory=Counter)  # ids refused with the expected 4xx
    abandoned: int = 0
    problems: list[str] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)


def _body(kind: str, request_id: str, rng: random.Random, max_model_len: int) -> tuple[str, dict]:
    base = {"model": "soak", "request_id": request_id, "ignore_eos": True, "temperature": rng.choice([0, 0.8])}
    if kind == "chat_stream":
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "tell me a story"}],
                                        "max_tokens": rng.randint(1, 24), "stream": True}
    prompt = " ".join(rng.choice(["the", "quick", "brown", "fox", "jumps"]) for _ in range(rng.randint(1, 24)))
    body = {**base, "prompt": prompt, "max_tokens": rng.randint(1, 24)}
    if kind == "n_best":
        body["n"] = rng.randint(2, 4)
    elif kind == "long":
        body.update(prompt=[rng.randrange(6, 500) for _ in range(max_model_len - 12)], max_tokens=8)
    elif kind in ("stream", "abandon"):
        body.update(stream=True, max_tokens=rng.randint(8, 48) if kind == "abandon" else body["max_tokens"])
    elif kind == "reject":
        body.update(rng.choice([{"max_tokens": 10**6}, {"temperature": -1}, {"seed": 2**64},
                                {"stop_token_ids": [10**9]}, {"logit_bias": {"x": 1}}]))
    return "/v1/completions", body


async def _one(client: httpx.AsyncClient, kind: str, request_id: str, rng: random.Random, tally: Tally,
               max_model_len: int) -> None:
    path, body = _body(kind, request_id, rng, max_model_len)
    if kind == "cancel":  # the client gives up while the request is queued or running
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        tally.abandoned += 1
        return
    if not body.get("stream"):
        response = await client.post(path, json=body)
        if kind == "reject":
            if response.status_code == 400 and response.json()["error"]["message"]:
                tally.rejected[request_id] += 1
            else:
                tally.problems.append(f"{request_id}: expected a 400, got {response.status_code}")
            return
        _check_complete(response.status_code, response.json() if response.status_code == 200 else response.text,
                        body, request_id, tally)
        return
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            tally.problems.append(f"{request_id}: {response.status_code} {await response.aread()!r}")
            return
        events, done = [], 0
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
            else:
                tally.problems.append(f"{request_id}: unexpected stream line {line[:80]!r}")
            if kind == "abandon" and len(events) >= 3:
                tally.abandoned += 1
                return  # leaving the block closes the connection mid-stream
    if done != 1 or any(e["id"] != request_id for e in events):
        tally.problems.append(f"{request_id}: {done} [DONE] lines, ids {sorted({e['id'] for e in events})[:3]}")
        return
    finishes = [c["index"] for e in events for c in e["choices"] if c.get("finish_reason")]
    tally.duplicated += len(finishes) != len(set(finishes))
    finished = set(finishes)
    if finished != set(range(body.get("n", 1))):
        tally.problems.append(f"{request_id}: finished choices {sorted(finished)}")
        return
    tally.completed[request_id] += 1


def _check_complete(status: int, payload, body: dict, request_id: str, tally: Tally) -> None:
    if status != 200:
        tally.problems.append(f"{request_id}: {status} {str(payload)[:200]}")
        return
    indexes = sorted(c["index"] for c in payload["choices"])
    tally.duplicated += len(indexes) != len(set(indexes))
    if payload["id"] != request_id or indexes != list(range(body.get("n", 1))) or \
            any(c["finish_reason"] not in ("stop", "length") for c in payload["choices"]):
        tally.problems.append(f"{request_id}: id {payload['id']}, choices {indexes}")
        return
    tally.completed[request_id] += 1


async def _server_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    gauges = {}
    for line in text.splitlines():
        for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            if line.startswith(f"tokenmill:{name}{{"):
                gauges[name] = float(line.rsplit(" ", 1)[1])
    return gauges


async def soak(base_url: str, num_requests: int, concurrency: int, rss_mib: Callable[[], float],
               max_model_len: int, seed: int = 0) -> dict:
    """Run the mix against ``base_url`` and return the report (see the module docstring)."""
    rng = random.Random(seed)
    tally = Tally()
    kinds = rng.choices(KINDS, weights=(3, 3, 2, 2, 1, 1, 1, 1), k=num_requests)
    # idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them, so no
    # request is sent on a connection the server is closing at that moment
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)
        started = time.perf_counter()

        async def run(index: int, kind: str) -> None:
            async with gate:
                try:
                    await _one(client, kind, f"soak-{index}", random.Random(seed * 1_000_003 + index), tally,
                               max_model_len)
                except httpx.TransportError as exc:  # a dropped connection is a finding, not a crash
                    tally.problems.append(f"soak-{index} ({kind}): {exc!r}")
                if index == num_requests // 2:
                    tally.rss_mib.append(rss_mib())

        # the first wave warms the server up (kernels, allocator pools), so "start" is after it
        warmup = min(concurrency, num_requests // 4)
        await asyncio.gather(*(run(i, kinds[i]) for i in range(warmup)))
        tally.rss_mib.append(rss_mib())
        await asyncio.gather(*(run(i, kinds[i]) for i in range(warmup, num_requests)))
        seconds = time.perf_counter() - started
        await asyncio.sleep(0.5)  # aborts of abandoned streams reach the engine loop
        gauges = await _server_gauges(client)
        health = (await client.get("/health")).status_code
        tally.rss_mib.append(rss_mib())
    expected = Counter(k for k in kinds if k not in ("cancel", "abandon", "reject"))
    lost = sum(expected.values()) - len(tally.completed)
    return {
        "num_requests": num_requests, "concurrency": concurrency, "kinds": dict(Counter(kinds)),
        "seconds": round(seconds, 2), "requests_per_s": round(num_requests / seconds, 1),
        "completed": len(tally.completed), "rejected_4xx": len(tally.rejected), "abandoned": tally.abandoned,
        "lost": lost, "duplicated": tally.duplicated, "problems": tally.problems[:20],
        "rss_mib_start_middle_end": [round(r, 1) for r in tally.rss_mib],
        "rss_growth_pct": round(100 * (tally.rss_mib[-1] / tally.rss_mib[0] - 1), 1),
        "kv_cache_usage_after": gauges.get("kv_cache_usage_perc"),
        "requests_running_after": gauges.get("num_requests_running"),
        "requests_waiting_after": gauges.get("num_requests_waiting"),
        "health_after": health,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_preset="tiny")
    parser.add_argument("--num-requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = prepare(args)
    command = [sys.executable, "-m", "tokenmill.cli", "serve", str(model), "--port", str(args.port),
               "--served-model-name", "soak", "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.concurrency), "--num-threads", str(args.threads), "--log-level", "warning"]
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(base_url, server)
        report = asyncio.run(soak(base_url, args.num_requests, args.concurrency,
                                  lambda: process_rss_mib(server.pid), args.max_model_len, args.seed))
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(report, indent=2))
    write_json(args.json, report)
    ok = report["lost"] == report["duplicated"] == 0 and report["kv_cache_usage_after"] == 0.0 \
        and not report["problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

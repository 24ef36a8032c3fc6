"""The load of ``tokenmill bench serve``: streaming /v1/completions requests at a rate and a
concurrency, each request's TTFT, inter-token latencies and end-to-end time.

Why processes: the client parses every streamed chunk (HTTP framing, one JSON object), some
tens of microseconds of its CPU per chunk in Python, so one event loop tops out at a few
ten thousand tokens a second: a GPU's server can stream faster than one client reads. With
``processes`` > 1 the prompts and the concurrency are split over that many load processes
(``python -m tokenmill.bench.serve_load``; the request rate too: Poisson arrivals split
are Poisson arrivals), which start together and report their results as JSON. Each pass
reports the share of its time the load processes were busy, so a client-bound figure shows.
This module imports no torch, so a load process starts in well under a second.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import msgspec
import numpy as np


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


class LoadSpec(msgspec.Struct, frozen=True):
    """One load process's share of a pass (JSON on its stdin)."""

    url: str
    model: str
    prompts: list[str]
    output_len: int
    #: requests a second (Poisson arrivals); None sends them all at once
    rate: Optional[float]
    concurrency: int
    seed: int
    extra: dict


class LoadDone(msgspec.Struct, frozen=True):
    """What a load process reports (JSON on its stdout): its requests' results, when its load
    began and ended (``time.perf_counter``: CLOCK_MONOTONIC, the same clock in every process)
    and the CPU seconds it used meanwhile."""

    results: list[Result]
    start: float
    end: float
    cpu: float


@dataclass
class Load:
    """A pass's results in prompt order, its wall time, and the load processes' busy share."""

    results: list[Result]
    duration: float
    client_busy: float


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int,
                      extra: dict) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    result = Result()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                # a token event; not a bare end-of-stream marker (llama.cpp streams special
                # tokens as empty text, so empty text alone does not mean "no token")
                if not choice or (not choice.get("text") and choice.get("finish_reason")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run_load(spec: LoadSpec) -> LoadDone:
    """The spec's requests from one event loop."""
    rng = np.random.default_rng(spec.seed)
    semaphore = asyncio.Semaphore(spec.concurrency)
    # a connection per request: llama.cpp's HTTP server closes kept-alive connections after a few
    # requests, and a request sent on one it has just closed fails without reaching the engine
    limits = httpx.Limits(max_connections=spec.concurrency + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def limited(prompt: str) -> Result:
            async with semaphore:
                return await one_request(client, spec.url, spec.model, prompt, spec.output_len, spec.extra)

        tasks = []
        cpu, start = time.process_time(), time.perf_counter()
        for prompt in spec.prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if spec.rate is not None:
                await asyncio.sleep(rng.exponential(1.0 / spec.rate))
        results = await asyncio.gather(*tasks)
        return LoadDone(list(results), start, time.perf_counter(), time.process_time() - cpu)


def split(spec: LoadSpec, processes: int) -> list[LoadSpec]:
    """The spec as ``processes`` shares (fewer if it has fewer prompts or less concurrency):
    prompts dealt round-robin, the concurrency and the rate divided, a seed each."""
    count = max(1, min(processes, spec.concurrency, len(spec.prompts)))
    return [msgspec.structs.replace(spec, prompts=spec.prompts[i::count],
                                    concurrency=spec.concurrency // count + (i < spec.concurrency % count),
                                    rate=None if spec.rate is None else spec.rate / count, seed=spec.seed + i)
            for i in range(count)]


def in_prompt_order(parts: list[list]) -> list:
    """The shares' items (results, or prompts) back in the order of the prompts ``split`` dealt."""
    merged: list = [None] * sum(len(part) for part in parts)
    for i, part in enumerate(parts):
        merged[i::len(parts)] = part
    return merged


def generate_load(spec: LoadSpec, processes: int = 1) -> Load:
    """Run the spec's load, from this process or from ``processes`` load processes."""
    shares = split(spec, processes)
    if len(shares) == 1:
        done = [asyncio.run(run_load(spec))]
    else:
        workers = [subprocess.Popen([sys.executable, "-m", "tokenmill.bench.serve_load"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in shares]
        try:
            for worker, share in zip(workers, shares):
                worker.stdin.write(msgspec.json.encode(share).decode() + "\n")
                worker.stdin.flush()
            for worker in workers:  # each has read its share and imported what it needs
                if worker.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load process failed to start")
            for worker in workers:
                worker.stdin.write("go\n")
                worker.stdin.close()
            done = [msgspec.json.decode(worker.stdout.read(), type=LoadDone) for worker in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                worker.wait()
    results = in_prompt_order([part.results for part in done])
    duration = max(part.end for part in done) - min(part.start for part in done)
    busy = sum(part.cpu for part in done) / (duration * len(done)) if duration > 0 else 0.0
    return Load(results, duration, busy)


def main() -> None:
    spec = msgspec.json.decode(sys.stdin.readline(), type=LoadSpec)
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every load process starts at once
    print(msgspec.json.encode(asyncio.run(run_load(spec))).decode(), flush=True)


if __name__ == "__main__":
    main()

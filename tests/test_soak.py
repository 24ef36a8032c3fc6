"""The short soak: 300 mixed requests (streams, aborts, n > 1, long prompts, 4xx) at 64 at once.
No response is lost, duplicated or crossed, and afterwards no KV block or request is left over."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from conftest import make_llm
from server_harness import running_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from soak import process_rss_mib, soak  # noqa: E402


def test_short_soak_keeps_every_invariant(model_dir):
    engine = make_llm(model_dir("llama"), max_model_len=128, max_num_seqs=64).llm_engine
    with running_server(engine, served_model_name=["soak"]) as (url, _):
        report = asyncio.run(soak(url, num_requests=300, concurrency=64, max_model_len=128,
                                  rss_mib=lambda: process_rss_mib(os.getpid())))
    assert report["problems"] == []
    assert report["lost"] == 0 and report["duplicated"] == 0
    kinds = report["kinds"]
    assert report["rejected_4xx"] == kinds["reject"]
    assert report["completed"] == 300 - kinds["reject"] - kinds["cancel"] - kinds["abandon"]
    assert report["kv_cache_usage_after"] == 0.0
    assert report["requests_running_after"] == report["requests_waiting_after"] == 0.0
    assert report["health_after"] == 200
    assert engine.scheduler.kv_cache.pool.usage() == 0.0 and not engine.has_unfinished_requests()

"""The deployment files: every metric the Grafana dashboard queries is one the server exports,
and the Docker image runs as a non-root user with a health check on /health."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_llm
from server_harness import running_server

ROOT = Path(__file__).resolve().parent.parent


def test_every_dashboard_query_names_an_exported_metric(model_dir):
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in queries for name in re.findall(r"tokenmill:[a-z0-9_]+", expr)}
    assert len(queried) >= 12
    with running_server(make_llm(model_dir("llama")).llm_engine, served_model_name=["tiny"]) as (url, _):
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3}
                          ).status_code == 200
        text = httpx.get(url + "/metrics").text
    exported = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert queried <= exported, sorted(queried - exported)


def test_the_image_runs_tokenmill_serve_as_a_non_root_user_with_a_health_check():
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK") for line in lines)
    assert "/health" in (ROOT / "Dockerfile").read_text()
    [entrypoint] = [json.loads(line.removeprefix("ENTRYPOINT ")) for line in lines if line.startswith("ENTRYPOINT")]
    assert entrypoint[:2] == ["tokenmill", "serve"]

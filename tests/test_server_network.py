"""Serving on an open network: TLS and mutual TLS, CORS, a proxy prefix, request-id headers,
disabled docs, and the API key on every route but the public ones. Each against a real
uvicorn server on 127.0.0.1 (tests/server_harness.py)."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import openai
import pytest
import trustme
from structlog.testing import capture_logs
from fastapi.routing import APIRoute
from starlette.routing import Mount

from tokenmill.core.config.server_config import ServerConfig
from tokenmill.interfaces.errors import ConfigError
from tokenmill.server.middleware import PUBLIC_PATHS, PUBLIC_PREFIXES
from tokenmill.server.transport import uvicorn_options

from conftest import make_llm
from server_harness import running_server


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_llm(model_dir("llama")).llm_engine


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("client@example.test")
    paths = {name: root / f"{name}.pem" for name in ("ca", "key", "cert", "client")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_pem.write_to_path(paths["key"])
    server.cert_chain_pems[0].write_to_path(paths["cert"])
    client.private_key_and_cert_chain_pem.write_to_path(paths["client"])
    return paths


def test_https_with_the_openai_client_streamed_and_not(engine, pki):
    with running_server(engine, served_model_name=["tiny"], ssl_keyfile=str(pki["key"]),
                        ssl_certfile=str(pki["cert"])) as (url, _):
        assert url.startswith("https://")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none",
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"])))
        done = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4
        streamed = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == done.choices[0].text
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(url + "/health")


def test_mutual_tls_refuses_a_client_without_a_certificate(engine, pki):
    with running_server(engine, ssl_keyfile=str(pki["key"]), ssl_certfile=str(pki["cert"]),
                        ssl_ca_certs=str(pki["ca"]), ssl_cert_reqs=2) as (url, _):
        anonymous = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url + "/health", verify=anonymous)
        identified = ssl.create_default_context(cafile=pki["ca"])
        identified.load_cert_chain(pki["client"])
        assert httpx.get(url + "/health", verify=identified).status_code == 200


@pytest.mark.parametrize("setting,key", [
    ({"ssl_keyfile": "/no/such/key.pem", "ssl_certfile": "/no/such/cert.pem"}, "server.ssl_keyfile"),
    ({"ssl_keyfile": "KEY"}, "server.ssl_certfile"),  # a key without its certificate
    ({"ssl_keyfile": "KEY", "ssl_certfile": "CA"}, "server.ssl_certfile"),  # not this key's certificate
    ({"ssl_keyfile": "KEY", "ssl_certfile": "CERT", "ssl_cert_reqs": 2}, "server.ssl_ca_certs"),
])
def test_tls_settings_that_cannot_work_are_config_errors(pki, setting, key):
    files = {"KEY": str(pki["key"]), "CERT": str(pki["cert"]), "CA": str(pki["ca"])}
    with pytest.raises(ConfigError) as info:
        uvicorn_options(ServerConfig(**{k: files.get(v, v) for k, v in setting.items()}))
    assert info.value.key == key


def test_serve_with_an_unreadable_certificate_says_so_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--ssl-keyfile", str(tmp_path / "k"),
                             "--ssl-certfile", str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "server.ssl_keyfile" in result.stderr and "Traceback" not in result.stderr


def test_cors_answers_allowed_origins_only(engine):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with running_server(engine, allowed_origins=["https://app.example"], api_key="k") as (url, _):
        answer = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answer.headers["access-control-allow-methods"]
        simple = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example",
                                                        "Authorization": "Bearer k"})
        assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "https://app.example"
        denied = httpx.get(url + "/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in denied.headers
        evil = httpx.options(url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in evil.headers
    with running_server(engine) as (url, _):  # the default: no origin is allowed
        answer = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in answer.headers


def test_root_path_behind_a_prefix_stripping_proxy(engine):
    """The proxy serves /tm/... and forwards it as /...: routes, auth and the docs' links work."""
    with running_server(engine, root_path="/tm", api_key="k") as (url, _):
        assert httpx.get(url + "/v1/models").status_code == 401  # auth sees the route under the prefix
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert {"url": "/tm"} in httpx.get(url + "/openapi.json").json()["servers"]
        assert "/tm/openapi.json" in httpx.get(url + "/docs").text


def test_request_id_headers_are_echoed_and_name_the_response(engine):
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2}
    with running_server(engine, served_model_name=["tiny"], enable_request_id_headers=True) as (url, _):
        with capture_logs() as logs:
            given = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
        assert given.headers["x-request-id"] == "trace-42" and given.json()["id"] == "cmpl-trace-42"
        [finished] = [e for e in logs if e["event"] == "request finished"]
        assert finished["request_id"].startswith("cmpl-trace-42-")  # the log line is found by the header
        again = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
        assert again.status_code == 200  # the same header twice: the engine's ids stay distinct
        made = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "bad id\twith spaces"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert made.json()["id"] == f"chatcmpl-{made.headers['x-request-id']}" != "chatcmpl-bad id\twith spaces"
        assert httpx.get(url + "/health").headers["x-request-id"]
    with running_server(engine, served_model_name=["tiny"]) as (url, _):
        plain = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
        assert "x-request-id" not in plain.headers and plain.json()["id"] != "cmpl-trace-42"


def test_disabled_docs_are_gone(engine):
    with running_server(engine, disable_fastapi_docs=True, api_key="k") as (url, _):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path).status_code == 404, path
        assert httpx.get(url + "/health").status_code == 200


def test_every_route_but_the_public_ones_needs_the_api_key(model_dir, tmp_path):
    """Enumerates the app's routes (runtime adapter routes on), so a route added later cannot
    be left open by forgetting to protect it."""
    llm = make_llm(model_dir("llama"), enable_lora=True, max_lora_rank=8)
    engine = llm.llm_engine
    engine.config.adapters.allow_runtime_lora_updating = True
    engine.config.adapters.allowed_lora_dirs = [str(tmp_path)]
    with running_server(engine, api_key="secret") as (url, served):
        from tokenmill.server.app import create_app

        app = create_app(served, ServerConfig(api_key="secret"))
        checked = 0
        for route in app.routes:
            if isinstance(route, Mount):
                assert route.path + "/" in PUBLIC_PREFIXES, route.path
                continue
            methods = route.methods if isinstance(route, APIRoute) else getattr(route, "methods", None) or {"GET"}
            path = route.path.replace("{", "").replace("}", "")
            for method in methods - {"HEAD"}:
                status = httpx.request(method, url + path, json={}).status_code
                if route.path in PUBLIC_PATHS:
                    assert status != 401, (method, route.path)
                else:
                    assert status == 401, (method, route.path, status)
                    checked += 1
        assert checked >= 8  # completions, chat, embeddings, models, tokenize, detokenize, adapters

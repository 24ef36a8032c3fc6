"""The OpenAPI schema is the contract: every route is described, and schemathesis holds the live
server to it (no 5xx, only documented statuses and content types, responses that match their models)."""

from __future__ import annotations

import collections
import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from conftest import make_llm
from server_harness import running_server

MODEL = "tiny"
#: examples per route and generation mode; FUZZ_EXAMPLES raises it for the longer run
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

#: "METHOD path" -> examples sent, reported at the end of the module
SENT: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # a short context bounds what any generated request can cost (n x max_tokens); the
    # adapter routes are on, over an empty allowed directory
    engine = make_llm(model_dir("llama"), max_model_len=64, enable_lora=True, allow_runtime_lora_updating=True,
                      allowed_lora_dirs=[str(tmp_path_factory.mktemp("adapters"))]).llm_engine
    with running_server(engine, served_model_name=[MODEL]) as (url, llm):
        before = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
        yield url, llm, before


@pytest.fixture(scope="module")
def api_schema(server):
    url, _, _ = server
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True)
    return schema


def test_schema_is_valid_openapi_31_and_describes_every_route(server):
    """Every POST has a request body model, every non-streaming 200 a response model; OpenAPI 3.1 valid."""
    url, _, _ = server
    schema = httpx.get(url + "/openapi.json").json()
    validate(schema)
    assert schema["openapi"].startswith("3.1")
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    posts = 0
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for status in ("400", "401", "404", "413", "500", "503"):
                error = responses[status]["content"]["application/json"]["schema"]
                expected = "HealthResponse" if (path, status) == ("/health", "503") else "ErrorResponse"
                assert error == {"$ref": f"#/components/schemas/{expected}"}, (path, status)
            ok = responses["200"]["content"]
            if path != "/metrics":
                assert ok["application/json"]["schema"].get("$ref", "").startswith("#/components/schemas/"), path
            if method == "post" and not path.endswith("/cancel"):  # OpenAI's cancel takes no body
                posts += 1
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].split("/")[-1] in components, path
    assert posts >= 5
    for path, chunk in (("/v1/completions", "CompletionStreamResponse"),
                        ("/v1/chat/completions", "ChatCompletionChunk")):
        stream = schema["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        assert stream["properties"]["data"]["contentSchema"]["$ref"] == f"#/components/schemas/{chunk}"
        assert chunk in components
    fields = components["CompletionRequest"]["properties"]
    assert {"top_k", "min_p", "repetition_penalty", "logit_bias", "stop_token_ids"} <= set(fields)
    assert all(fields[name].get("description") for name in ("top_k", "min_p", "logit_bias", "seed"))


def test_validation_errors_are_openai_400s_not_422(server):
    """FastAPI's own validation error keeps OpenAI's envelope and status."""
    url, _, _ = server
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": "many"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_live_server_conforms_to_its_schema(case, server):
    """Generated requests, valid and invalid: never a 5xx, only documented statuses and content
    types, schema-valid responses; schema-invalid bodies get a 4xx; /health stays 200."""
    url, _, _ = server
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance, negative_data_rejection], timeout=120)
    SENT[f"{case.method.upper()} {case.path}"] += 1
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_fuzzing_left_the_engine_as_it_was(server):
    """After the fuzzing: every POST route got examples, and greedy output is what it was before."""
    url, llm, before = server
    if not SENT:
        pytest.skip("runs after test_live_server_conforms_to_its_schema, whose examples it checks")
    print("schemathesis examples per route:", dict(SENT))
    posts = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings",
             "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert all(SENT[f"POST {path}"] >= EXAMPLES for path in posts), SENT
    after = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert llm.engine.scheduler.kv_cache.pool.usage() == 0.0
    assert json.loads(httpx.get(url + "/health").text) == {"status": "ok"}

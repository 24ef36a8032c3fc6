"""OpenAI's Responses API through the ``openai`` client's ``responses`` resource, against a
real server: text input and instructions, conversation items, streamed events, function
tools (and their calls back as input), ``text.format``, usage, retrieval and cancel."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import make_llm
from server_harness import running_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(model_dir):
    engine = make_llm(model_dir("llama"), max_num_seqs=8).llm_engine
    with running_server(engine, served_model_name=[MODEL]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_text(client, messages, **kwargs) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content


def test_text_input_and_instructions_answer_as_the_chat_path_does(client):
    response = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello there"}], max_tokens=8)
    assert response.output_text == expected and response.object == "response"
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status in ("completed", "incomplete")
    if response.usage.output_tokens == 8:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_build_the_same_response(client):
    args = dict(model=MODEL, input=[{"role": "user", "content": "Tell me a story"}], max_output_tokens=10,
                temperature=0)
    whole = client.responses.create(**args)
    deltas, kinds, final = [], [], None
    with client.responses.stream(**args) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status == whole.status
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stored_response_is_retrieved_and_cannot_be_cancelled(client, served):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert httpx.get(f"{served}/v1/responses/{unstored.id}").status_code == 404


def test_function_tools_are_called_and_their_outputs_go_back_as_input(client):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                             "required": ["city"], "additionalProperties": False}}]
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=80)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    followup = client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], tool_choice="none")
    assert followup.output_text and followup.usage.input_tokens > response.usage.input_tokens


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Is it ok?", max_output_tokens=20, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                        "strict": True}})
    assert set(json.loads(response.output_text)) == {"ok"}


@pytest.mark.parametrize("field,value", [("previous_response_id", "resp_x"), ("background", True),
                                         ("no_such_field", 1)])
def test_unsupported_fields_are_refused_by_name(served, field, value):
    answer = httpx.post(f"{served}/v1/responses", json={"model": MODEL, "input": "x", field: value}, timeout=30)
    assert answer.status_code == 400 and field in json.dumps(answer.json())

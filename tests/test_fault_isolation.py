"""A failure while one request is processed fails that request alone: the others stream on and
finish correctly, the failing one gets an error that names it, and /health stays 200."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from conftest import make_llm
from server_harness import running_server
from tokenmill.core.engine.detokenizer import IncrementalDetokenizer
from tokenmill.core.sample.logits_processors import LogitBias

MODEL = "tiny"
#: the markers that make the injected faults fire for one request only
STOP_FAULT = "<fail-in-stop-check>"
SAMPLER_FAULT_TOKEN, SAMPLER_FAULT_BIAS = 77, 13.0


@pytest.fixture
def faults(monkeypatch):
    """A stop check that raises for requests with STOP_FAULT among their stop strings, and a
    sampler that raises for rows whose logit_bias carries the sentinel."""
    update, bias = IncrementalDetokenizer.update, LogitBias.apply

    def failing_update(self, token_ids):
        if STOP_FAULT in self._stop:
            raise RuntimeError("injected stop-check failure")
        return update(self, token_ids)

    def failing_bias(self, logits):
        if any(biases.get(SAMPLER_FAULT_TOKEN) == SAMPLER_FAULT_BIAS for biases in self._rows.values()):
            raise RuntimeError("injected sampler failure")
        return bias(self, logits)

    monkeypatch.setattr(IncrementalDetokenizer, "update", failing_update)
    monkeypatch.setattr(LogitBias, "apply", failing_bias)


def test_one_failing_request_fails_alone_while_others_stream(model_dir, faults):
    engine = make_llm(model_dir("llama")).llm_engine
    prompts = ["The quick brown fox", "Once upon a time", "In a galaxy far away"]
    with running_server(engine, served_model_name=[MODEL]) as (url, llm):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        greedy = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        expected = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]

        streamed: dict[int, str] = {}
        failures: dict[str, object] = {}

        def stream(i):
            chunks = client.completions.create(prompt=prompts[i], stream=True, **greedy)
            streamed[i] = "".join(chunk.choices[0].text for chunk in chunks)

        def failing_stream():
            body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True, "stop": [STOP_FAULT]}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                failures["stream"] = [line for line in response.iter_lines() if line]

        def failing_sample():
            body = {"model": MODEL, "prompt": "x", "max_tokens": 40,
                    "logit_bias": {str(SAMPLER_FAULT_TOKEN): SAMPLER_FAULT_BIAS}}
            failures["sample"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        threads += [threading.Thread(target=failing_stream), threading.Thread(target=failing_sample)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)

        assert [streamed[i] for i in range(len(prompts))] == expected
        lines = failures["stream"]
        assert lines[-1] == "data: [DONE]" and "event: error" in lines
        error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "injected stop-check failure" in error["message"]
        assert "request cmpl-" in error["message"]
        response = failures["sample"]
        assert response.status_code == 500
        assert "injected sampler failure" in response.json()["error"]["message"]
        assert response.json()["error"]["message"].startswith("request cmpl-")

        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert llm.error is None
        assert client.completions.create(prompt=prompts[0], **greedy).choices[0].text == expected[0]
        assert engine.scheduler.kv_cache.pool.usage() == 0.0


def test_a_failing_row_in_a_batch_is_found_by_running_the_batch_one_request_at_a_time(model_dir, faults):
    """Offline, deterministically in one batch: the sampler raises for one row, the step is
    retried request by request, the others get the tokens a clean run gives them."""
    from tokenmill import SamplingParams

    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    clean = make_llm(model_dir("llama")).generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                  use_tqdm=False)
    engine = make_llm(model_dir("llama")).llm_engine
    poisoned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                              logit_bias={SAMPLER_FAULT_TOKEN: SAMPLER_FAULT_BIAS})
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy)
    engine.add_request("bad", {"prompt_token_ids": [41, 42, 43]}, poisoned)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "injected sampler failure" in finals["bad"].error
    assert finals["bad"].outputs[0].finish_reason == "error"
    for i, expected in enumerate(clean):
        got = finals[f"r{i}"]
        assert got.error is None and got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert [e[t].logprob for e, t in zip(got.outputs[0].logprobs, got.outputs[0].token_ids)] == \
            pytest.approx([e[t].logprob for e, t in zip(expected.outputs[0].logprobs, expected.outputs[0].token_ids)],
                          abs=1e-5)
    assert engine.scheduler.kv_cache.pool.usage() == 0.0


def test_a_step_failing_after_sampling_is_retried_with_the_generators_wound_back(model_dir, monkeypatch):
    """The failure comes after the seeded rows drew their samples: the retry rewinds their
    generators, so a seeded batch-mate samples exactly what a clean run gives it."""
    from tokenmill import SamplingParams
    from tokenmill.core.sample.sampler import LogprobValues

    entries = LogprobValues.entries

    def failing_entries(self, token_ids, ks):
        if 7 in ks:
            raise RuntimeError("injected logprobs failure")
        return entries(self, token_ids, ks)

    monkeypatch.setattr(LogprobValues, "entries", failing_entries)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    clean = make_llm(model_dir("llama")).generate([{"prompt_token_ids": [11, 12, 13]}], seeded, use_tqdm=False)
    engine = make_llm(model_dir("llama")).llm_engine
    engine.add_request("seeded", {"prompt_token_ids": [11, 12, 13]}, seeded)
    engine.add_request("bad", {"prompt_token_ids": [41, 42]},
                       SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=7))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "injected logprobs failure" in finals["bad"].error
    assert finals["seeded"].error is None
    assert finals["seeded"].outputs[0].token_ids == clean[0].outputs[0].token_ids


def test_the_retries_run_without_the_failed_steps_tensors(model_dir, monkeypatch):
    """A step that raises (on a GPU: out of memory) is retried one request at a time; the
    tensors of the failed attempt, which its exception's frames hold, are freed first."""
    import weakref

    from tokenmill import SamplingParams

    bias, failed, alive_in_retries = LogitBias.apply, [], []

    def failing_bias(self, logits):
        if failed:
            alive_in_retries.append(failed[0]() is not None)
        if any(biases.get(SAMPLER_FAULT_TOKEN) == SAMPLER_FAULT_BIAS for biases in self._rows.values()):
            failed.append(weakref.ref(logits))
            raise RuntimeError("injected sampler failure")
        return bias(self, logits)

    monkeypatch.setattr(LogitBias, "apply", failing_bias)
    engine = make_llm(model_dir("llama")).llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={5: 1.0})
    engine.add_request("ok", {"prompt_token_ids": [11, 12, 13]}, params)
    poisoned = SamplingParams(temperature=0, max_tokens=2, logit_bias={SAMPLER_FAULT_TOKEN: SAMPLER_FAULT_BIAS})
    engine.add_request("bad", {"prompt_token_ids": [41, 42, 43]}, poisoned)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["ok"].error is None and "injected sampler failure" in finals["bad"].error
    assert alive_in_retries and not any(alive_in_retries)

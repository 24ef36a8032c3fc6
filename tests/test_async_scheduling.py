"""Async scheduling (``async_scheduling``, vLLM's name): step N+1 is scheduled and launched before
step N's result is read, a decoding request's next input being the placeholder its token in
flight fills on the device. Each request must come out exactly as it does step by step: the
same tokens and logprobs (HF's, for greedy), the same stops, seeded samples, prompt logprobs,
with requests that wait every other step (penalties, grammars), aborts and reused ids between
steps, and a KV cache too small for all of them.
"""

from __future__ import annotations

import threading

import openai
import pytest
import torch
from conftest import PREEMPTING, PROMPTS, make_llm
from server_harness import running_server
from test_device_boundaries import fake_cuda_llm, greedy, launch_waits
from test_fault_isolation import SAMPLER_FAULT_BIAS, SAMPLER_FAULT_TOKEN, faults  # noqa: F401 (a fixture)

from tokenmill import SamplingParams
from tokenmill.core.worker.model_runner import _Samples
from tokenmill.core.worker.placeholder_tokens import PlaceholderTokens
from tokenmill.interfaces.batch import PLACEHOLDER_TOKEN
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.testing.device_queue import host_syncs
from tokenmill.testing.fake_cuda import fake_cuda
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy

#: chunked prefill in 16-token steps, so prompts take several steps and share them with decodes
SMALL_STEPS = dict(max_num_batched_tokens=16, block_size=8, max_num_seqs=4)


def engines(model_dir, arch: str = "llama", **args):
    """The same engine step by step and with async scheduling, whose launches are recorded."""
    sync = make_llm(model_dir(arch), **{**SMALL_STEPS, **args})
    overlapped = make_llm(model_dir(arch), async_scheduling=True, **{**SMALL_STEPS, **args})
    overlapped.launched = []
    runner = overlapped.llm_engine.runner
    launch = runner.launch

    def recording_launch(batch, *rest, **kwargs):
        overlapped.launched.append(batch)
        return launch(batch, *rest, **kwargs)

    runner.launch = recording_launch
    return sync, overlapped


def placeholders(llm) -> int:
    """Scheduled decode rows whose input token was still in flight."""
    return sum(item.new_token_ids[0] == PLACEHOLDER_TOKEN for batch in llm.launched for item in batch.scheduled)


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def same_completions(a, b) -> None:
    """The same tokens, text and stops; logprobs equal to fp32's noise (the two batch rows
    differently, and a GEMM's sums follow its rows' blocking)."""
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x.outputs, y.outputs, strict=True):
            assert (u.token_ids, u.text, u.finish_reason, u.stop_reason) == \
                (v.token_ids, v.text, v.finish_reason, v.stop_reason)
            assert same_logprobs(u.logprobs, v.logprobs)
            assert u.cumulative_logprob == pytest.approx(v.cumulative_logprob, abs=1e-4)
        assert same_logprobs(x.prompt_logprobs, y.prompt_logprobs)


def same_logprobs(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (p is None and q is None) or (p.keys() == q.keys() and all(
            p[t].rank == q[t].rank and p[t].logprob == pytest.approx(q[t].logprob, abs=1e-5) for t in p))
        for p, q in zip(a, b))


def test_greedy_decoding_is_hfs_and_the_step_by_step_engines(model_dir):
    """Prompts of 5-60 tokens (1-4 chunks), 1-20 new tokens: the tokens and logprobs of the
    engine that runs step by step, and HF's; most decode rows took their token in flight."""
    prompts = [(p * 3)[:n] for p, n in zip(PROMPTS, (60, 17, 9, 40, 5, 33))]
    max_tokens = [20, 7, 1, 12, 3, 16]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    sync, overlapped = engines(model_dir)
    got = generate(overlapped, prompts, params)
    same_completions(generate(sync, prompts, params), got)
    assert placeholders(overlapped) > sum(max_tokens) // 2
    reference = hf_greedy(model_dir("llama"), prompts, max_tokens)
    assert_matches_reference(reference, [o.outputs[0].token_ids for o in got],
                             [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                              for o in got])
    assert overlapped.llm_engine.scheduler.kv_cache.pool.usage() == 0.0


def test_stops_seeds_and_prompt_logprobs_come_out_as_step_by_step(model_dir):
    """A stop token and a stop string the host sees one step late (the step after runs, and its
    token is dropped), seeded sampling with n = 2, top-k/top-p/min-p, and prompt logprobs."""
    prompts = [p[:20] for p in PROMPTS[:4]]
    sync, overlapped = engines(model_dir)
    free = generate(sync, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_token = free[0].outputs[0].token_ids[4]
    stop_text = free[1].outputs[0].text[5:9]
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, seed=7, n=2, max_tokens=10,
                       ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
    ]
    expected = generate(sync, prompts, params)
    assert expected[0].outputs[0].finish_reason == "stop" and expected[1].outputs[0].stop_reason == stop_text
    same_completions(expected, generate(overlapped, prompts, params))
    assert placeholders(overlapped) > 0
    assert overlapped.llm_engine.scheduler.kv_cache.pool.usage() == 0.0


def test_requests_that_read_their_history_wait_for_their_token_and_come_out_the_same(model_dir):
    """Penalties, min_tokens, bad words and a grammar read the tokens generated so far: those
    requests skip a step rather than sample on a stale history; batch-mates go on in flight."""
    prompts = [p[:12] for p in PROMPTS[:5]]
    sync, overlapped = engines(model_dir)
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=["a", "the"]),
        SamplingParams(temperature=0, max_tokens=10,
                       structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]+")),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    ]
    same_completions(generate(sync, prompts, params), generate(overlapped, prompts, params))
    history = {f"{i}" for i in range(4)}
    rows = [(item.request_id, item.new_token_ids[0]) for batch in overlapped.launched for item in batch.scheduled]
    assert not any(token == PLACEHOLDER_TOKEN for request_id, token in rows if request_id.split("\x00")[0] in history)
    assert any(token == PLACEHOLDER_TOKEN for _, token in rows)


def test_a_kv_cache_too_small_for_all_preempts_between_steps_in_flight(model_dir):
    """24 blocks of 8 tokens for 12 prompts of up to 150 tokens: requests find no blocks
    while every other one is in flight; they wait a step, preemption runs once nothing is,
    and every request comes out as step by step."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    sync, overlapped = engines(model_dir, **{**PREEMPTING, "max_num_batched_tokens": 64, "max_num_seqs": 6})
    prompts = [p[:100] for p in PROMPTS]
    same_completions(generate(sync, prompts, params), generate(overlapped, prompts, params))
    scheduler = overlapped.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0 and placeholders(overlapped) > 0
    assert scheduler.kv_cache.pool.num_free_blocks == PREEMPTING["num_gpu_blocks_override"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priorities_preempt_requests_whose_step_is_in_flight(mode, model_dir):
    """Mixed priorities over 24 blocks: better ones take the place of requests whose step is in
    flight. The preempted request loses that step's token (the runner drops it, so its history
    stays the scheduler's) and recomputes it; every request, penalised ones included, comes out
    as step by step."""
    args = dict(**PREEMPTING, scheduling_policy="priority", preemption_mode=mode, max_num_batched_tokens=64)
    sync, overlapped = engines(model_dir, **args)
    scheduler = overlapped.llm_engine.scheduler
    preempt, in_flight = scheduler._preempt, []

    def watched(request, step):
        in_flight.append(request.request_id in scheduler.in_flight)
        return preempt(request, step)

    scheduler._preempt = watched
    engine, histories_differ = overlapped.llm_engine, []
    step = engine.step

    def checked_step():  # between steps the runner's history of a request is the scheduler's
        outputs = step()
        states = engine.runner._states
        histories_differ.extend(request_id for request_id, r in scheduler.requests.items()
                                if request_id in states and states[request_id].output_token_ids != r.output_token_ids)
        return outputs

    engine.step = checked_step
    prompts = [p[:90] for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0,
                             repetition_penalty=1.2 if i % 4 == 0 else 1.0) for i in range(len(prompts))]
    priority = [i % 3 for i in range(len(prompts))]
    same_completions(sync.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   priority=priority),
                     overlapped.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                         priority=priority))
    assert any(in_flight), "no request was preempted while its step was in flight"
    assert histories_differ == []
    assert scheduler.kv_cache.pool.num_free_blocks == PREEMPTING["num_gpu_blocks_override"]


def test_an_abort_and_a_reused_id_between_steps_in_flight(model_dir):
    """A request aborted while its step is in flight ends as aborted, the others as step by
    step; an id reused as soon as its request finished (its last step still in flight) names a
    new request that comes out as it does on a fresh engine."""
    sync, overlapped = engines(model_dir)
    engine = overlapped.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    # "a" stops on a token: the host learns it a step late, with the step after in flight
    stop = generate(sync, [PROMPTS[0][:10]], greedy)[0].outputs[0].token_ids[4]
    stopping = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], logprobs=0)
    fresh = [generate(make_llm(model_dir("llama")), [PROMPTS[i][:10]], params)[0].outputs[0].token_ids
             for i, params in ((0, stopping), (2, greedy))]
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0][:10]}, stopping)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1][:10]}, greedy)
    finals, aborted, reused = {}, False, False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals.setdefault(output.request_id, []).append(output)
                if output.request_id == "a" and not reused:  # its last step is still in flight
                    assert "a" in engine.scheduler.in_flight
                    engine.add_request("a", {"prompt_token_ids": PROMPTS[2][:10]}, greedy)
                    reused = True
            elif output.request_id == "b" and len(output.outputs[0].token_ids) >= 3 and not aborted:
                assert "b" in engine.scheduler.in_flight
                finals["b"] = engine.abort_request("b")
                aborted = True
    assert reused and aborted
    first, second = finals["a"]
    assert first.outputs[0].token_ids == fresh[0] and second.outputs[0].token_ids == fresh[1]
    assert first.outputs[0].finish_reason == "stop" and len(fresh[0]) == 5
    assert finals["b"][0].outputs[0].finish_reason == "abort"
    assert engine.scheduler.kv_cache.pool.usage() == 0.0


def test_aborting_every_request_leaves_the_engine_idle(model_dir):
    """Pausing with abort, sleep and a cache reset wait for an idle engine: once every request is
    aborted, no step of theirs is left in flight to keep it busy."""
    _, overlapped = engines(model_dir)
    engine = overlapped.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i][:10]}, greedy)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.in_flight
    assert {o.outputs[0].finish_reason for o in engine.abort_request(["0", "1", "2"])} == {"abort"}
    assert not engine.has_unfinished_requests() and not engine.scheduler.in_flight
    assert engine.scheduler.kv_cache.pool.usage() == 0.0


def test_streams_from_the_server_are_the_step_by_step_completions(model_dir):
    """Through uvicorn and the openai client: streamed and whole completions from an engine with
    async scheduling are the text the engine that runs step by step gives."""
    sync, overlapped = engines(model_dir)
    greedy = dict(model="m", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The quick brown fox", "Once upon a time", "In a galaxy far away"]
    expected = [o.outputs[0].text for o in sync.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    with running_server(overlapped.llm_engine, served_model_name=["m"]) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        results: dict[int, tuple[str, str]] = {}

        def complete(i):
            whole = client.completions.create(prompt=prompts[i], **greedy).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[i], stream=True,
                                                                                     **greedy))
            results[i] = (whole, streamed)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert [results[i] for i in range(len(prompts))] == [(text, text) for text in expected]


@pytest.mark.usefixtures("faults")
def test_a_request_whose_step_fails_to_launch_fails_alone(model_dir):
    """The sampler raises for one row while another step is in flight: that step lands first,
    then the batch runs one request at a time; only the poisoned request ends, as an error."""
    prompts = [PROMPTS[i][:12] for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    sync, overlapped = engines(model_dir)
    clean = generate(sync, prompts, greedy)
    engine = overlapped.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy)
    finals = {}
    for _ in range(3):  # the three are decoding, a step in flight, when the poisoned one comes
        engine.step()
    engine.add_request("bad", {"prompt_token_ids": PROMPTS[5][:4]},
                       SamplingParams(temperature=0, max_tokens=8,
                                      logit_bias={SAMPLER_FAULT_TOKEN: SAMPLER_FAULT_BIAS}))
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "injected sampler failure" in finals["bad"].error
    same_completions(clean, [finals[f"r{i}"] for i in range(3)])
    assert engine.scheduler.kv_cache.pool.usage() == 0.0


def test_by_default_it_is_on_for_a_device_and_off_on_the_cpu(model_dir):
    """vLLM's default: on where the model runs on a GPU (here the CUDA stand-in), off on the
    CPU, where the forward pass runs on the host; off where it cannot serve (speculative
    decoding) rather than refused; False turns it off."""
    assert not make_llm(model_dir("llama")).llm_engine.scheduler.async_scheduling
    with fake_cuda():
        assert fake_cuda_llm(model_dir("llama")).llm_engine.scheduler.async_scheduling
        assert not fake_cuda_llm(model_dir("llama"), async_scheduling=False).llm_engine.scheduler.async_scheduling
        speculating = fake_cuda_llm(model_dir("llama"), enforce_eager=True,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 2})
        assert not speculating.llm_engine.scheduler.async_scheduling


def test_what_async_scheduling_cannot_serve_is_refused_at_startup(model_dir):
    with pytest.raises(ConfigError, match="speculative decoding"):
        make_llm(model_dir("llama"), async_scheduling=True,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="one process"):
        make_llm(model_dir("llama"), async_scheduling=True, tensor_parallel_size=2)


def test_on_the_cuda_stand_in_a_step_is_launched_without_waiting_for_the_one_in_flight(model_dir):
    """The cuda platform's engine on the CPU's CUDA stand-in (device tensors, staged inputs,
    decode steps replayed from recorded graphs), with async scheduling: HF's tokens and
    logprobs, each placeholder filled on the device (in a graph's input buffer too), and not
    one wait for the device while a decode step is launched (``host_syncs``: no read back,
    no blocking copy), which is what lets a GPU run that step while the host reads the last."""
    prompts, max_tokens = [p[:14] for p in PROMPTS[:3]], [8, 6, 3]
    tokens, logprobs, decodes, reads = stand_in_decode_waits(model_dir, prompts, max_tokens)
    reference = hf_greedy(model_dir("llama"), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)
    assert len(decodes) >= 4
    assert [events for events in decodes if events] == []
    # reading a step's tokens waits for that step's mark only, never for the step queued after it
    assert reads and all(events == ["waited for a recorded event"] for events in reads)


def test_mutation_tokens_read_from_the_device_wait_for_the_step_after(model_dir, monkeypatch):
    """Without the host copies queued at sampling, reading a step's tokens is a read back from
    the device, which on a GPU waits for everything queued since: the step launched after it."""
    monkeypatch.setattr(_Samples, "copy_to_host", lambda self, staging: None)
    _, _, _, reads = stand_in_decode_waits(model_dir, [PROMPTS[0][:14]], [6])
    assert reads and all(any("of a device tensor" in event for event in events) for events in reads)


def test_on_the_cuda_stand_in_prompt_logprobs_and_sampling_rows_come_out_as_on_the_cpu(model_dir):
    """A step with prompt-logprob rows picks its sampling rows out of the logits through a staged
    index (a host index is a blocking copy on a GPU), and its prompt logprobs go to the host
    with its tokens (read from the logits, they would wait for the step launched since); tokens
    and prompt logprobs are the CPU engine's."""
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    prompts = [PROMPTS[0][:12], PROMPTS[1][:9]]
    reads = []
    device, waits = stand_in_launch_waits(model_dir, prompts, params, reads)
    same_completions(generate(make_llm(model_dir("llama"), block_size=8), prompts, params), device)
    assert device[0].prompt_logprobs is not None and waits == []
    # the prompt logprobs came back with the step's tokens: its reads waited for its marks only
    assert reads and all(set(events) <= {"waited for a recorded event"} for events in reads)


RANDOM_ROWS = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=5, ignore_eos=True),
               SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                              frequency_penalty=0.3, max_tokens=5, ignore_eos=True, logprobs=2, seed=5),
               SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True)]


def stand_in_launch_waits(model_dir, prompts, params, reads=None):
    """The completions on the CUDA stand-in (async scheduling, its default there) and the host's
    waits for the device while each step was launched; with ``reads`` (a list), the waits of
    each step's read (``runner.finish``) are appended to it."""
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"))
        waits = launch_waits(llm)
        if reads is not None:
            runner = llm.llm_engine.runner
            finish = runner.finish

            def watched_finish(launched):
                with host_syncs() as events:
                    result = finish(launched)
                reads.append(events)
                return result

            runner.finish = watched_finish
        return generate(llm, prompts, params), waits


def random_rows_on_the_stand_in(model_dir):
    return stand_in_launch_waits(model_dir, [p[:10] for p in PROMPTS[:3]], RANDOM_ROWS)


def test_on_the_cuda_stand_in_random_rows_with_penalties_launch_without_a_wait(model_dir):
    """Temperature, top-k/top-p, min-p, the three penalties, logprobs and seeds: the sampler
    moves every host value with non-blocking copies, so launching such a step waits for nothing
    (a blocking copy on a GPU waits for the step in flight), and a seeded request samples the
    same again (its generator is its own, on the device)."""
    device, waits = random_rows_on_the_stand_in(model_dir)
    assert waits == []
    again, _ = random_rows_on_the_stand_in(model_dir)
    for index in (1, 2):
        assert device[index].outputs[0].token_ids == again[index].outputs[0].token_ids


#: a request for each built-in logits processor (a grammar's is structured outputs)
PROCESSOR_ROWS = {
    "logit_bias": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={5: 4.0, 17: -100.0}),
    "allowed_token_ids": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                        allowed_token_ids=[3, 5, 7, 11, 13]),
    "bad_words": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=["a", "the"]),
    "min_tokens": SamplingParams(temperature=0, max_tokens=6, min_tokens=4),
    "structured_outputs": SamplingParams(temperature=0, max_tokens=10,
                                         structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]+")),
}


def processor_rows_on_the_stand_in(model_dir, name):
    """A processor's request beside a plain one (which ends first, so the batch changes under
    the processor): the completions on the stand-in, and the launches' waits."""
    params = [PROCESSOR_ROWS[name], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    prompts = [PROMPTS[0][:10], PROMPTS[1][:10]]
    return prompts, params, *stand_in_launch_waits(model_dir, prompts, params)


@pytest.mark.parametrize("name", PROCESSOR_ROWS)
def test_on_the_cuda_stand_in_each_logits_processor_launches_without_a_wait(name, model_dir):
    """Each built-in processor moves its indices, biases and masks with non-blocking copies (a
    grammar's bitmask crosses packed and is unpacked on the device): launching its steps waits
    for nothing, and its request comes out as on the CPU."""
    prompts, params, device, waits = processor_rows_on_the_stand_in(model_dir, name)
    assert waits == []
    same_completions(generate(make_llm(model_dir("llama"), block_size=8), prompts, params), device)


@pytest.mark.parametrize("name,module", [("logit_bias", "logit_bias"), ("structured_outputs", "bitmask")])
def test_mutation_a_processor_moving_host_values_with_blocking_copies_waits(name, module, model_dir, monkeypatch):
    import importlib

    package = "tokenmill.core.structured_output." if module == "bitmask" else "tokenmill.core.sample.logits_processors."
    monkeypatch.setattr(importlib.import_module(package + module), "on_device",
                        lambda device, values, dtype=None: torch.as_tensor(values, dtype=dtype).to(device))
    assert processor_rows_on_the_stand_in(model_dir, name)[3]


def test_mutation_penalties_moved_with_blocking_copies_are_waits(model_dir, monkeypatch):
    """The sampler's host values moved with blocking copies (as ``torch.tensor(..., device=)``
    does): the stand-in sees the waits."""
    from tokenmill.core.sample import sampler

    def blocking(device, values, dtype=None):
        return torch.as_tensor(values, dtype=dtype).to(device)

    monkeypatch.setattr(sampler, "on_device", blocking)
    assert random_rows_on_the_stand_in(model_dir)[1]


def test_mutation_a_placeholder_written_through_a_host_index_is_a_wait(model_dir, monkeypatch):
    """Filling the placeholders by indexing the input ids with a host list gives the same
    tokens, but on a GPU it is a blocking copy that waits for the step in flight."""

    def host_indexed_fill(self, input_ids, put):
        input_ids[self.rows] = torch.stack([tokens[index] for tokens, index in self.sources]).to(input_ids.dtype)

    monkeypatch.setattr(PlaceholderTokens, "fill", host_indexed_fill)
    _, _, decodes, _ = stand_in_decode_waits(model_dir, [PROMPTS[0][:14]], [6])
    assert decodes and all("indexing a device tensor with host indices" in events for events in decodes)


def stand_in_decode_waits(model_dir, prompts, max_tokens):
    """Greedy tokens and logprobs of an async engine on the CUDA stand-in; the host's waits for
    the device while each decode step that took a placeholder was launched, and while each
    step that sampled was read (``runner.finish``)."""
    waits, reads = [], []
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), async_scheduling=True)
        runner = llm.llm_engine.runner
        launch, finish = runner.launch, runner.finish

        def watched_launch(batch, *args, **kwargs):
            with host_syncs() as events:
                launched = launch(batch, *args, **kwargs)
            waits.append((batch, events))
            return launched

        def watched_finish(launched):
            with host_syncs() as events:
                result = finish(launched)
            if launched.sample_items:
                reads.append(events)
            return result

        runner.launch, runner.finish = watched_launch, watched_finish
        tokens, logprobs = greedy(llm, prompts, max_tokens)
        assert sum(graph.replays for graph in llm.llm_engine.runner.model_step.graphs.graphs.values()) > 0
    decodes = [events for batch, events in waits
               if any(item.new_token_ids[0] == PLACEHOLDER_TOKEN for item in batch.scheduled)
               and all(len(item.new_token_ids) == 1 for item in batch.scheduled)]
    return tokens, logprobs, decodes, reads

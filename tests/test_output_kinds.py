"""vLLM's ``output_kind``: each step's cumulative output (CUMULATIVE), only what is new
(DELTA), or one output at the end (FINAL_ONLY, what ``LLM.generate`` asks for). All three
report the same request: the deltas add up to the cumulative output, the final output is it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from conftest import PROMPTS
from tokenmill import RequestOutput, RequestOutputKind, SamplingParams
from tokenmill.interfaces.errors import InvalidRequest

KINDS = list(RequestOutputKind)


def run(engine, params: SamplingParams, kind: RequestOutputKind) -> dict[str, list[RequestOutput]]:
    """Every output the engine returns, by request, for PROMPTS[:3] under ``kind``."""
    params = replace(params, output_kind=kind)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"{kind.name}-{i}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id.split("-")[1]].append(output)
    return outputs


def joined(deltas: list[RequestOutput]) -> dict[int, dict]:
    """Each sequence's deltas put back together."""
    seqs: dict[int, dict] = defaultdict(lambda: dict(text="", token_ids=[], logprobs=[], finish_reason=None))
    for output in deltas:
        for completion in output.outputs:
            seq = seqs[completion.index]
            assert seq["finish_reason"] is None, "a sequence went on after its finish was reported"
            assert completion.token_ids or completion.text or completion.finish_reason, "an empty delta"
            seq["text"] += completion.text
            seq["token_ids"] += completion.token_ids
            seq["logprobs"] += completion.logprobs
            seq["finish_reason"] = completion.finish_reason
            seq["cumulative_logprob"] = completion.cumulative_logprob
    return seqs


def reported(output: RequestOutput) -> dict[int, dict]:
    return {c.index: dict(text=c.text, token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                          cumulative_logprob=c.cumulative_logprob) for c in output.outputs}


def test_the_three_kinds_report_the_same_request(llama):
    """Sampled (seeded), n=2, logprobs, prompt logprobs and a stop string that holds text back."""
    engine = llama.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=1)
    probe = run(engine, params, RequestOutputKind.FINAL_ONLY)["0"][0].outputs[0].text
    params = replace(params, stop=(probe[4:6],))  # ends sequence 0 early; the others may run to max_tokens
    got = {kind: run(engine, params, kind) for kind in KINDS}
    for request, cumulative in got[RequestOutputKind.CUMULATIVE].items():
        final = cumulative[-1]
        assert final.finished and all(not o.finished for o in cumulative[:-1])
        [only] = got[RequestOutputKind.FINAL_ONLY][request]
        assert only.finished and reported(only) == reported(final)
        assert only.prompt_logprobs == final.prompt_logprobs
        deltas = got[RequestOutputKind.DELTA][request]
        assert len(deltas) == len(cumulative) and deltas[-1].finished
        assert joined(deltas) == reported(final)
        assert deltas[0].prompt_logprobs == final.prompt_logprobs
        assert len(final.prompt_logprobs) == len(PROMPTS[int(request)])
        assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert got[RequestOutputKind.CUMULATIVE]["0"][-1].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_stream_interval_reports_the_first_token_then_every_k_and_the_end(llama, kind):
    """stream_interval=4 over 10 tokens: outputs after tokens 1, 5, 9 and 10, reporting the same
    request as an interval of 1 (n=2, seeded, logprobs, a stop string that holds text back)."""
    engine = llama.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=1,
                            stop=("\u00a7\u00a7",))
    every = run(engine, params, kind)
    spaced = run(engine, replace(params, stream_interval=4), kind)
    for request, outputs in spaced.items():
        counts = [max(len(c.token_ids) for c in o.outputs) for o in outputs]
        if kind is RequestOutputKind.DELTA:
            assert counts == [1, 4, 4, 1] and joined(outputs) == joined(every[request])
        else:
            assert counts == [1, 5, 9, 10] and reported(outputs[-1]) == reported(every[request][-1])
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])


@pytest.mark.parametrize("interval", [0, -2, 1.5, "4", None])
def test_a_stream_interval_below_one_or_not_an_integer_is_refused(interval):
    with pytest.raises(InvalidRequest, match="stream_interval"):
        SamplingParams(stream_interval=interval)


def test_an_aborted_delta_request_reports_its_finish_without_new_tokens(llama):
    engine = llama.llm_engine
    engine.add_request("aborted", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(max_tokens=50, temperature=0, output_kind=RequestOutputKind.DELTA))
    [first] = engine.step()
    assert len(first.outputs[0].token_ids) == 1
    [last] = engine.abort_request("aborted")
    assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []


def test_a_final_only_request_returns_nothing_until_it_ends(llama):
    engine = llama.llm_engine
    engine.add_request("final", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert [len(outputs) for outputs in steps] == [0, 0, 0, 1]
    assert len(steps[-1][0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kind", [3, -1, "DELTA", True, 1.0, None])
def test_an_unknown_output_kind_is_refused(kind):
    with pytest.raises(InvalidRequest, match="output_kind"):
        SamplingParams(output_kind=kind)

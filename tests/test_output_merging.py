"""A stream whose reader falls behind gets the outputs that piled up as one (vLLM's output
collector, ``RequestOutput.add``): the same text, tokens and logprobs, in fewer chunks."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_llm
from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.interfaces.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams

step = st.lists(st.tuples(st.text(max_size=3), st.lists(st.integers(0, 99), max_size=2)), min_size=2, max_size=2)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=6), missing=st.lists(st.booleans(), min_size=12, max_size=12))
def test_folded_deltas_hold_what_each_step_added(steps, missing):
    """Two sequences (n=2), each step adding text and tokens to either or both of them: folded
    together they read as the steps' concatenation; the prompt logprobs come from the first,
    the finish from the last."""
    outputs = []
    for number, new in enumerate(steps):
        last = number == len(steps) - 1
        completions = [CompletionOutput(index, text, tokens, -float(number), [{t: Logprob(-1.0)} for t in tokens],
                                        "length" if last else None)
                       for index, (text, tokens) in enumerate(new) if last or not missing[2 * number + index]]
        outputs.append(RequestOutput("r", None, [1], [None] if number == 0 else None, completions, last))
    expected = {index: ("", [], []) for index in range(2)}
    for output in outputs:
        for c in output.outputs:
            text, tokens, logprobs = expected[c.index]
            expected[c.index] = (text + c.text, tokens + c.token_ids, logprobs + c.logprobs)
    folded = outputs[0]
    for later in outputs[1:]:
        folded.add(later, aggregate=True)
    assert folded.finished and folded.prompt_logprobs == [None]
    got = {c.index: (c.text, c.token_ids, c.logprobs) for c in folded.outputs}
    assert got == {index: value for index, value in expected.items() if index in got}
    assert all(c.finish_reason == "length" and c.cumulative_logprob == -float(len(steps) - 1) for c in folded.outputs)


def test_a_reader_that_falls_behind_gets_one_output_for_the_steps_it_missed(model_dir):
    llm = make_llm(model_dir("llama"))
    prompt = {"prompt_token_ids": [5, 9, 33, 71]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    offline = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    served = AsyncLLM(llm.llm_engine)

    async def read(kind: RequestOutputKind, request_id: str) -> list[RequestOutput]:
        outputs = []
        async for output in served.generate(request_id, prompt, SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, output_kind=kind)):
            outputs.append(output)
            await asyncio.sleep(0.5)  # busy elsewhere while the engine goes on
        return outputs

    try:
        deltas = asyncio.run(read(RequestOutputKind.DELTA, "delta"))
        cumulative = asyncio.run(read(RequestOutputKind.CUMULATIVE, "cumulative"))
    finally:
        served.shutdown(1.0)
    assert 1 < len(deltas) < 24 and 1 < len(cumulative) < 24
    assert [t for o in deltas for t in o.outputs[0].token_ids] == offline.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == offline.text
    assert [entry for o in deltas for entry in o.outputs[0].logprobs] == offline.logprobs
    assert cumulative[-1].outputs[0].token_ids == offline.token_ids and cumulative[-1].outputs[0].text == offline.text

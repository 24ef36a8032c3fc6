"""GenerationPause, which both serving loops pause with (AsyncLLM's thread, the engine-core
process), over a real engine: a "wait" pause takes effect once nothing runs, each of its
callers is answered, a resume answers the pauses still waiting, requests that arrive while
paused are held in order, a pause while paused is answered at once, and "abort" ends the
running requests."""

from __future__ import annotations

import asyncio

import pytest

from conftest import make_llm
from server_harness import ENGINE_MODES, served_engine
from tokenmill import SamplingParams
from tokenmill.core.engine.generation_pause import GenerationPause

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_pauses_wait_hold_resume_and_abort(model_dir):
    with make_llm(model_dir("llama")) as llm:
        engine = llm.llm_engine
        pause: GenerationPause[str, str] = GenerationPause(engine)
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, PARAMS)
        engine.step()
        assert pause.pause("wait", False, "a") == [] and pause.pause("wait", True, "b") == []
        assert pause.holds and not pause.paused and pause.settle() == []
        pause.held += ["late", "later"]
        assert pause.resume() == (["late", "later"], ["a", "b"])  # the pause is over: both answered
        assert not pause.holds

        pause.pause("wait", False, "c")
        while engine.has_unfinished_requests():
            assert pause.settle() == []
            engine.step()
        assert pause.settle() == ["c"] and pause.paused
        pause.pause("wait", False, "d")
        assert pause.settle() == ["d"]  # nothing runs while paused: nothing to wait for
        assert pause.resume() == ([], [])

        engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, PARAMS)
        engine.step()
        aborted = pause.pause("abort", True, "e")
        assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in aborted] == [("s", True, "abort")]
        assert pause.settle() == ["e"] and not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_a_request_held_by_a_pause_and_abandoned_never_runs(model_dir, mode):
    """A request that arrives while generation is paused waits; if its caller goes away
    first, resuming does not run it, and it no longer counts as waiting."""
    with served_engine(mode, str(model_dir("llama")), kv_cache_memory_bytes=16 * 2**20) as llm:
        async def scenario() -> list[tuple[int, int]]:
            await llm.pause_generation("keep")
            stream = llm.generate("held", {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                                  SamplingParams(max_tokens=400, ignore_eos=True))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.3)
            first.cancel()  # the caller goes away: its stream closes and aborts the request
            await asyncio.sleep(0.3)
            await llm.resume_generation()
            counts = []
            for _ in range(100):
                await asyncio.sleep(0.01)
                counts.append((llm.num_waiting, llm.num_running))
            return counts

        counts = asyncio.run(scenario())
    assert all(running == 0 for _, running in counts) and counts[-1] == (0, 0), counts

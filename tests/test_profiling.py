"""Profiling an engine (vLLM's ``start_profile`` / ``stop_profile`` and ``profiler_config``)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import make_llm
from tokenmill import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_start_and_stop_profile_write_each_ranks_trace(model_dir, tmp_path):
    """vLLM's start_profile / stop_profile with its profiler_config: a Chrome trace per rank
    of what ran between them; without the config, a clear refusal."""
    with make_llm(model_dir("llama"), tensor_parallel_size=2,
                  profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)}) as llm:
        llm.start_profile()
        llm.generate("profile me", GREEDY, use_tqdm=False)
        traces = llm.stop_profile()
    assert [os.path.basename(t).split("-")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        names = {event.get("name") for event in json.loads(open(trace).read())["traceEvents"]}
        assert any(name and name.startswith("aten::") for name in names)
    with make_llm(model_dir("llama")) as plain:
        with pytest.raises(ValueError, match="set profiler_config"):
            plain.start_profile()

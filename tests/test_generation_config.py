"""A model's generation_config.json gives the sampling defaults of requests that leave them
unset (vLLM's --generation-config auto, its default); ``vllm`` ignores the file, a directory
reads its own, and --override-generation-config wins over both."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from conftest import make_llm
from server_harness import running_server
from tokenmill import SamplingParams
from tokenmill.core.config.generation_defaults import sampling_defaults
from tokenmill.interfaces.errors import ConfigError

PROMPT = [5, 9, 33, 71, 2, 8]


@pytest.fixture
def model_with_defaults(model_dir, tmp_path):
    """The tiny Llama whose generation_config.json asks for greedy replies of 5 tokens."""
    path = tmp_path / "model"
    shutil.copytree(model_dir("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 5,
                                                             "top_k": 0, "do_sample": True}))
    return path


def test_modes_and_overrides(model_with_defaults, model_dir, tmp_path):
    assert sampling_defaults(model_with_defaults, "auto", {}) == {"temperature": 0.0, "max_tokens": 5, "top_k": -1}
    assert sampling_defaults(model_with_defaults, "vllm", {}) == {}
    assert sampling_defaults(model_dir("llama"), str(model_with_defaults), {})["max_tokens"] == 5  # another dir's
    assert sampling_defaults(model_with_defaults, "auto", {"temperature": 0.7})["temperature"] == 0.7
    assert sampling_defaults(model_with_defaults, "vllm", {"top_p": 0.9}) == {"top_p": 0.9}
    with pytest.raises(ConfigError, match="unknown fields"):
        sampling_defaults(model_with_defaults, "auto", {"temprature": 0.5})
    with pytest.raises(ConfigError, match="does not exist"):
        sampling_defaults(model_with_defaults, str(tmp_path / "nowhere"), {})
    with pytest.raises(ConfigError, match="invalid"):
        sampling_defaults(model_with_defaults, "auto", {"top_p": 2.0})


def test_offline_generate_without_parameters_takes_the_models_defaults(model_with_defaults):
    llm = make_llm(model_with_defaults)
    assert llm.get_default_sampling_params().temperature == 0.0
    default = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert default == greedy and len(default) == 5


@pytest.mark.parametrize("mode,override,defaults_apply", [
    ("auto", {}, True), ("vllm", {}, False), ("vllm", {"temperature": 0.0, "max_new_tokens": 5}, True)])
def test_requests_that_leave_fields_unset_take_the_defaults(model_with_defaults, mode, override, defaults_apply):
    engine = make_llm(model_with_defaults, generation_config=mode, override_generation_config=override,
                      max_model_len=64).llm_engine
    with running_server(engine, served_model_name=["m"]) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        unset = client.completions.create(model="m", prompt=PROMPT, seed=3, extra_body={"ignore_eos": True})
        greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
        explicit = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert explicit.usage.completion_tokens == 3  # a request's own fields win (max_new_tokens only caps them)
    if defaults_apply:
        assert unset.usage.completion_tokens == 5 and unset.choices[0].text == greedy.choices[0].text
    else:  # OpenAI's defaults: temperature 1, and 16 tokens for a completion
        assert unset.usage.completion_tokens == 16 and not unset.choices[0].text.startswith(greedy.choices[0].text)

"""Platforms: loud selection, and a contract enough for a platform the core has never heard of."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field
from structlog.testing import capture_logs

from conftest import NEW_TOKENS, PROMPTS, greedy_in_batches, with_platforms
from tokenmill import LLM, load_config
from tokenmill.core.layers.linear import Linear
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.errors import ConfigError, UnknownComponent
from tokenmill.interfaces.platform import Detection, Platform
from tokenmill.testing.hf_reference import assert_matches_reference


class ReferencePlatform(Platform):
    """CPU, eager reference: no optimisation pass, no greedy head, float32 whatever is stored."""

    name = "cpu-reference"
    priority = -1  # never preferred over the real cpu platform under "auto"

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return torch.float32


class MissingDevice(Platform):
    name = "imaginary"
    device_type = "imaginary"
    priority = 100

    @classmethod
    def detect(cls) -> Detection:
        return Detection(False, "no imaginary device is attached (driver not loaded)")


class TunedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lanes: int = Field(4, ge=1)


class Tuned(ReferencePlatform):
    """A platform with a config section of its own."""

    name = "tuned"
    options_model = TunedOptions


class FasterFake(ReferencePlatform):
    name = "faster-fake"
    priority = 50


def build(model_dir, pm, **overrides) -> LLM:
    return LLM(config=load_config(model=str(model_dir("llama")), kv_cache_memory_bytes=2**24, **overrides),
               plugin_manager=pm)


def test_a_platform_defined_here_selected_from_yaml_matches_hf(model_dir, hf_reference, tmp_path):
    """The contract is enough for a platform the core has never heard of: chosen by name in
    YAML, it runs the model through its own (empty) optimisation pass at HF parity."""
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "platform": {"name": "cpu-reference"},
                                      "cache": {"kv_cache_memory": 2**24}}))
    llm = LLM(config=load_config(config), plugin_manager=with_platforms(ReferencePlatform))
    engine = llm.llm_engine
    assert isinstance(engine.platform, ReferencePlatform)
    assert engine.runner.greedy_head is None
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and not any(hasattr(m, "packed_weight") for m in linears)  # no prepacking ran
    tokens, logprobs = greedy_in_batches(llm, PROMPTS, batch=4)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)


def test_auto_takes_the_usable_platform_with_the_highest_priority_and_says_why_not_the_others(model_dir):
    with capture_logs() as logs:
        llm = build(model_dir, with_platforms(MissingDevice, FasterFake))
    assert llm.llm_engine.platform.name == "faster-fake"
    passed_over = {entry["platform"]: entry for entry in logs if entry["event"].startswith("platform not")}
    assert "driver not loaded" in passed_over["imaginary"]["reason"]
    assert "faster-fake" in passed_over["cpu"]["reason"]
    # expected on a machine without that device: said, but not as a warning (none is, here)
    assert not [entry for entry in logs if entry["log_level"] == "warning"]
    [chosen] = [entry for entry in logs if entry["event"] == "platform selected"]
    assert chosen["platform"] == "faster-fake" and "auto" in chosen["why"]


def test_auto_without_extra_platforms_is_cpu(model_dir):
    with capture_logs() as logs:
        llm = build(model_dir, make_plugin_manager())
    assert llm.llm_engine.platform.name == "cpu" and llm.llm_engine.runner.greedy_head is not None
    assert any(entry["event"] == "platform selected" and entry["platform"] == "cpu" for entry in logs)


def test_an_unusable_explicit_platform_is_an_error_with_its_reason(model_dir):
    with pytest.raises(ConfigError, match="driver not loaded") as info:
        build(model_dir, with_platforms(MissingDevice), device="imaginary")
    assert info.value.key == "platform.name"


def test_an_unknown_platform_lists_the_registered_ones(model_dir):
    with pytest.raises(UnknownComponent, match="cpu"):
        build(model_dir, make_plugin_manager(), platform={"name": "tpu"})


def test_tokenmill_plugins_lists_the_cpu_platform():
    listing = json.loads(subprocess.run([sys.executable, "-m", "tokenmill.cli", "plugins", "--json"],
                                        capture_output=True, text=True, check=True).stdout)
    assert listing["hookspec_version"] >= 2
    registers = {p["name"]: p["registers"] for p in listing["plugins"]}
    assert registers["cpu_platform"] == {"platforms": ["cpu"], "attention_backends": ["cpu"]}


def test_the_cpu_section_from_yaml_reaches_the_platform(model_dir, tmp_path):
    """``platform: {name: cpu, cpu: {...}}`` is the cpu platform's own section; the flat names
    (``num_threads``) are aliases into it."""
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "cache": {"kv_cache_memory": 2**24},
                                      "platform": {"name": "cpu", "cpu": {"num_threads": 1, "huge_pages": False}}}))
    before = torch.get_num_threads()
    try:
        llm = LLM.from_config(config)
        assert torch.get_num_threads() == 1
        options = llm.llm_engine.platform.options
        assert options.num_threads == 1 and options.huge_pages is False and options.small_batch_gemv is True
        assert load_config(config, num_threads=2).platform.sections()["cpu"] == {"num_threads": 2, "huge_pages": False}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("section,key", [
    ({"num_threads": 0}, "platform.cpu.num_threads"),
    ({"num_thread": 2}, "platform.cpu.num_thread"),  # a typo is an error, not ignored
    ({"huge_pages": "sometimes"}, "platform.cpu.huge_pages"),
])
def test_a_bad_cpu_option_names_its_dotted_key(model_dir, section, key):
    with pytest.raises(ConfigError) as info:
        build(model_dir, make_plugin_manager(), platform={"name": "cpu", "cpu": section})
    assert info.value.key == key


def test_a_section_for_no_registered_platform_is_an_error(model_dir):
    with pytest.raises(ConfigError, match="no platform 'tpu' is registered") as info:
        build(model_dir, make_plugin_manager(), platform={"tpu": {"cores": 8}})
    assert info.value.key == "platform.tpu"


def test_a_plugin_platform_validates_its_own_section_and_ignores_others_loudly(model_dir):
    with capture_logs() as logs:
        llm = build(model_dir, with_platforms(Tuned), platform={"name": "tuned", "tuned": {"lanes": 8},
                                                                "cpu": {"num_threads": 1}})
    assert llm.llm_engine.platform.options == TunedOptions(lanes=8)
    assert any(entry["event"] == "options ignored" and entry["section"] == "platform.cpu" for entry in logs)
    with pytest.raises(ConfigError) as info:
        build(model_dir, with_platforms(Tuned), platform={"name": "tuned", "tuned": {"lanes": 0}})
    assert info.value.key == "platform.tuned.lanes"


def test_cuda_platform_is_registered_and_refuses_a_machine_without_cuda():
    """`tokenmill serve --platform cuda` without CUDA fails at startup with the reason (no fallback
    to the CPU); 'auto' passes over the cuda platform here, saying why."""
    import subprocess
    import sys

    import torch

    from tokenmill.core.plugin_host.components import collect_components
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager

    cuda = collect_components(make_plugin_manager()).platforms.get("cuda")
    found = cuda.detect()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert not found.usable and "CUDA" in found.reason
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--platform", "cuda", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"platform 'cuda' cannot run here: {found.reason}" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cuda.options_model(gpu_memory_utilization=1.5)


def test_input_staging_reuses_its_host_buffers():
    """Each input goes through one persistent host buffer (pinned on a GPU), grown when a step
    needs more, and arrives on the device with its values."""
    import numpy as np

    from tokenmill.core.worker.input_staging import InputStaging

    made = []

    def host_buffer(shape, dtype):
        made.append((tuple(shape), dtype))
        return torch.zeros(tuple(shape), dtype=dtype)

    staging = InputStaging("cpu", host_buffer)  # on the host, the "device" copy is the buffer itself
    assert staging.to_device("ids", np.arange(6, dtype=np.int64).reshape(2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert staging.to_device("ids", np.array([7, 8], dtype=np.int64)).tolist() == [7, 8]
    assert made == [((6,), torch.int64)]  # the second step reused the buffer
    staging.to_device("ids", np.arange(9, dtype=np.int64))
    assert made[-1] == ((12,), torch.int64)  # grown (doubled)

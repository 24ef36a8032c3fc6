"""Configuration precedence, strictness, and checkpoint-format tolerance."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import PROMPTS, make_llm
from tokenmill import SamplingParams, load_config
from tokenmill.core.config.model_config import normalize_hf_config
from tokenmill.interfaces.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_precedence_defaults_yaml_env_arguments(tmp_path, monkeypatch):
    """defaults < YAML < TOKENMILL_* env < explicit arguments, merged per key."""
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump({"scheduler": {"max_num_seqs": 9, "policy": "from-yaml"},
                                    "cache": {"block_size": 32}}))
    assert load_config().scheduler.max_num_seqs == 256
    config = load_config(path)
    assert (config.scheduler.max_num_seqs, config.scheduler.policy, config.cache.block_size) == (9, "from-yaml", 32)
    monkeypatch.setenv("TOKENMILL_SCHEDULER__MAX_NUM_SEQS", "7")
    config = load_config(path)
    assert (config.scheduler.max_num_seqs, config.scheduler.policy) == (7, "from-yaml")
    config = load_config(path, max_num_seqs=3, block_size=8)
    assert (config.scheduler.max_num_seqs, config.cache.block_size) == (3, 8)


def test_compilation_config_from_yaml_and_env_and_bad_json_in_env(tmp_path, monkeypatch):
    """compilation_config as YAML, as a nested or a whole-JSON TOKENMILL_* variable; a variable
    whose JSON does not parse is a ConfigError naming the field, not a traceback."""
    path = tmp_path / "engine.yaml"
    path.write_text("compilation_config: {custom_ops: [none, +rms_norm]}\n")
    assert load_config(path).compilation_config.custom_ops == ["none", "+rms_norm"]
    monkeypatch.setenv("TOKENMILL_COMPILATION_CONFIG__CUSTOM_OPS", '["-rms_norm"]')
    assert load_config(path).compilation_config.custom_ops == ["-rms_norm"]
    monkeypatch.delenv("TOKENMILL_COMPILATION_CONFIG__CUSTOM_OPS")
    monkeypatch.setenv("TOKENMILL_COMPILATION_CONFIG", '{"custom_ops": ["all", "-silu_and_mul"]}')
    assert not load_config().compilation_config.op_enabled("silu_and_mul")
    monkeypatch.setenv("TOKENMILL_COMPILATION_CONFIG", '{"custom_ops": ["none"')
    with pytest.raises(ConfigError, match="compilation_config"):
        load_config()
    monkeypatch.delenv("TOKENMILL_COMPILATION_CONFIG")
    # the section as JSON text beside a flat name inside it: they merge, in either order
    for args in ({"compilation_config": '{"custom_ops": ["none"]}', "cudagraph_capture_sizes": [1, 2]},
                 {"cudagraph_capture_sizes": [1, 2], "compilation_config": '{"custom_ops": ["none"]}'}):
        section = load_config(**args).compilation_config
        assert (section.custom_ops, section.cudagraph_capture_sizes) == (["none"], [1, 2])


def test_unknown_yaml_key_is_an_error_with_its_path(tmp_path):
    """A typo in YAML fails with the dotted key, never silently ignored."""
    path = tmp_path / "engine.yaml"
    path.write_text("scheduler:\n  max_num_seq: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "scheduler.max_num_seq"


@pytest.mark.parametrize("kwargs,key", [
    ({"max_num_seqs": 0}, "scheduler.max_num_seqs"),
    ({"dtype": "float8"}, "dtype"),
    ({"kv_cache_memory_bytes": "lots"}, "cache.kv_cache_memory"),
    ({"max_num_seq": 4}, "max_num_seq"),
    ({"kv_cache_dtype": "fp8"}, "cache.kv_cache_dtype"),
])
def test_bad_values_and_unknown_arguments_name_their_key(kwargs, key):
    """Out-of-range values and unknown vLLM-style arguments name the offending key."""
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert info.value.key == key


def test_yaml_model_path_is_relative_to_the_yaml_file(model_dir, tmp_path):
    """A relative model path in YAML resolves next to the file, not the working directory."""
    shutil.copytree(model_dir("llama"), tmp_path / "models" / "demo")
    path = tmp_path / "engine.yaml"
    path.write_text("model: models/demo\n")
    assert load_config(path).model == str((tmp_path / "models" / "demo").resolve())


def test_transformers4_config_spelling_loads_identically(model_dir, tmp_path):
    """rope_theta + rope_scaling{type} + torch_dtype (transformers 4) equal rope_parameters + dtype (5)."""
    source = model_dir("llama3")
    target = tmp_path / "v4"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    (target / "config.json").write_text(json.dumps(config))
    assert normalize_hf_config(config)["rope_parameters"]["rope_type"] == "llama3"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    expected = [o.outputs[0].token_ids for o in make_llm(source).generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected


def test_sharded_checkpoint_with_index_loads(model_dir, tmp_path):
    """Weights split across shards with model.safetensors.index.json give the same model."""
    source = model_dir("qwen2")
    target = tmp_path / "sharded"
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[::2], names[1::2])):
        filename = f"model-0000{shard + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, target / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    expected = [o.outputs[0].token_ids for o in make_llm(source).generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected


def test_pickled_checkpoints_are_refused(model_dir, tmp_path):
    """A directory with only pytorch_model.bin is refused, never unpickled."""
    target = tmp_path / "pickled"
    shutil.copytree(model_dir("llama"), target)
    (target / "model.safetensors").rename(target / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="never loaded"):
        make_llm(target)


def test_missing_weights_are_named(model_dir, tmp_path):
    """A checkpoint lacking a tensor fails at load, naming the parameter."""
    target = tmp_path / "partial"
    shutil.copytree(model_dir("llama"), target)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ConfigError, match="model.norm.weight"):
        make_llm(target)


def test_kv_pool_smaller_than_one_sequence_is_refused(model_dir):
    """A KV cache that cannot hold one max_model_len sequence fails at startup with the numbers."""
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        make_llm(model_dir("llama"), num_gpu_blocks_override=4, block_size=16)


def test_a_bf16_kv_cache_holds_twice_the_blocks_in_the_same_memory(model_dir):
    """cache.kv_cache_dtype sizes the pool: a bf16 cache under fp32 compute fits twice the blocks."""
    def blocks(**args):
        engine = make_llm(model_dir("llama"), kv_cache_memory_bytes=4 * 2**20, max_num_seqs=1024, **args).llm_engine
        caches = [m.kv_cache for m in engine.runner.model.modules() if hasattr(m, "kv_cache")]
        return engine.scheduler.kv_cache.pool.num_blocks, {c.dtype for c in caches}

    fp32, bf16 = blocks(), blocks(kv_cache_dtype="bfloat16")
    assert fp32[1] == {torch.float32} and bf16[1] == {torch.bfloat16}
    assert bf16[0] == 2 * fp32[0]


def test_unchunked_budget_below_context_is_refused(model_dir):
    """Without chunked prefill the batch budget must fit the longest prompt."""
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_llm(model_dir("llama"), enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_unsupported_rope_type_names_the_field(model_dir, tmp_path):
    """A rope scaling type no layer implements fails at load, naming rope_type."""
    target = tmp_path / "yarn"
    shutil.copytree(model_dir("llama"), target)
    config = json.loads((target / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "made-up", "rope_theta": 10000.0}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_type"):
        make_llm(target)
